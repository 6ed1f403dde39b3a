"""A Ray driver shaped like OpenRLHF 0.11.2's ``openrlhf.cli.train_ppo_ray.train``: ``ray.init`` only when Ray is not
initialized, with OpenRLHF's runtime_env (its three env_vars), then an actor in a fresh Ray worker process. Run by
tests/openrlhf/test_openrlhf_ray.py directly and through ``python -m grpo_kernels.openrlhf``; prints (JSON) whether
the worker's ``openrlhf.models.actor.Actor.forward`` is grpo_kernels' and what the worker's environment holds."""
import json
import os

import ray


@ray.remote(num_cpus=0)
class Probe:
    def where(self):
        import openrlhf.models.actor as actor_module

        forward = actor_module.Actor.forward
        return {"forward": f"{forward.__module__}.{forward.__name__}", "pid": os.getpid(),
                "NCCL_DEBUG": os.environ.get("NCCL_DEBUG"),
                "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM")}


def main():
    if not ray.is_initialized():
        ray.init(
            runtime_env={
                "env_vars": {
                    "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "true"),
                    "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
                    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1"),
                }
            },
            num_cpus=1, include_dashboard=False, object_store_memory=80 * 2**20,  # small, for a shared test machine
        )
    try:
        print("PROBE " + json.dumps({"driver_pid": os.getpid(), **ray.get(Probe.remote().where.remote())}))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
