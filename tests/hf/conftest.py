"""The TRL trainer tests' shared fixtures: saved tiny Llamas (tied and untied heads) with a word-level tokenizer."""
import pytest

from ..support.trl_runs import save_tiny_lm


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    """A saved tiny Llama + word-level tokenizer: GRPOTrainer builds its reference model from the path."""
    return save_tiny_lm(tmp_path_factory.mktemp("tiny_llama"), tied=False)


@pytest.fixture(scope="module")
def tiny_lm_tied(tmp_path_factory):
    return save_tiny_lm(tmp_path_factory.mktemp("tiny_llama_tied"), tied=True)
