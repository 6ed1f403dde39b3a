"""Entry points: ``python -m grpo.train [options]``, ``torchrun --nproc_per_node N -m grpo.train [options]``, and
``grpo.train.train(TrainConfig(...))`` from Python.

Without ``--output-dir`` each run gets a new folder ``runs/version_N`` (N one more than the largest there), printed
at start; ``--resume`` without it continues the newest ``runs/version_N`` holding a checkpoint (see
``run_folder.default_output_dir``).

Every bad argument or input file ends the command with one line ``grpo.train: error: ...`` and exit status 2
(argparse's own errors included); so does a run folder in use by another run (see grpo/run_folder.py). A file of the
run that cannot be written (disk full, read-only, no permission) ends it with one line and exit status 1.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import warnings

from .config import TrainConfig, quiet_unused_deepspeed
from .errors import OutputError, UsageError


def train(config: TrainConfig) -> dict:
    """Run (or resume) one training run; returns ``history`` (the metrics.jsonl records of this run), ``evals``,
    ``summary``, ``param_checksums`` and ``output_dir`` (the run folder: ``config.output_dir``, or when that is None
    the one chosen, see ``run_folder.default_output_dir``). Raises UsageError for bad input. Joins the torchrun
    process group when the environment has one."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*generation_config.*")
    quiet_unused_deepspeed()
    from .distributed import barrier, cleanup_distributed, init_distributed
    from .run_folder import RunLock, default_output_dir
    from .trainer import Trainer

    try:
        env = init_distributed(config.device, group_for_one=config.fsdp)
        if config.output_dir is None:  # every rank gets rank 0's choice before anything is written
            config = dataclasses.replace(config, output_dir=default_output_dir(config.resume, env))
        with RunLock(config.output_dir, env):  # one run per folder, taken before anything is written into it
            result = Trainer(config, env).train()
            barrier(env)  # leave together: no rank tears down its connections while another still uses them
    finally:
        cleanup_distributed()
    result["output_dir"] = config.output_dir
    return result


def main(argv=None) -> int:
    from .cli import config_from_argv

    rank = int(os.environ.get("RANK", "0"))
    try:
        train(config_from_argv(argv))
    except UsageError as exc:
        if rank == 0:
            print(f"grpo.train: error: {exc}", file=sys.stderr)
        return 2
    except OutputError as exc:
        if rank == 0:
            print(f"grpo.train: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("grpo.train: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
