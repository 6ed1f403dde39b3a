"""Entry point: ``python -m grpo.train [options]`` or ``torchrun --nproc_per_node N -m grpo.train [options]``.

Bad arguments and input files end the run with one line ``grpo.train: error: ...`` and exit status 2.
"""
from __future__ import annotations

import os
import sys
import warnings

from .errors import UsageError


def main(argv=None) -> int:
    from .cli import parse_args

    rank = int(os.environ.get("RANK", "0"))
    try:
        args = parse_args(argv)  # argparse's own errors exit(2) with the usage line
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        warnings.filterwarnings("ignore", message=".*generation_config.*")
        from .distributed import barrier, cleanup_distributed, init_distributed
        from .trainer import Trainer

        try:
            env = init_distributed(args.device)
            Trainer(args, env).train()
            barrier(env)  # leave together: no rank tears down its connections while another still uses them
        finally:
            cleanup_distributed()
    except UsageError as exc:
        if rank == 0:
            print(f"grpo.train: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("grpo.train: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
