"""Sharded lm_heads (docs/distributed.md):

- ``vocab_parallel``: a vocabulary shard per rank of a tensor-parallel group (``process_group=``);
- ``sharded_head``: a head sharded for data parallelism (FSDP2 DTensor, DeepSpeed ZeRO-3 ``gather_head``), gathered
  whole around the call.
"""
