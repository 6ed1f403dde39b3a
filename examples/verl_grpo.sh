#!/usr/bin/env bash
# verl 0.9.1 GRPO with verl's fused-kernel path on grpo_kernels (docs/verl.md). The three overrides
# actor_rollout_ref.model.external_lib / use_fused_kernels / fused_kernel_options.impl_backend are all it takes; the
# rest is an ordinary verl GRPO run. A launch command for a GPU machine with verl 0.9.1, its rollout engine and
# grpo-kernels installed, and GSM8K prepared by verl's examples/data_preprocess/gsm8k.py. This project's tests do not
# run it: tests/verl/test_verl_config.py checks that every override names a field of verl 0.9.1's config and that
# verl's own loader imports grpo_kernels.verl. ENGINE=megatron runs verl's Megatron engine (tensor-parallel
# vocabulary shards; impl_backend is not read there). Extra overrides pass through: bash examples/verl_grpo.sh k=v
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
DATA=${DATA:-$HOME/data/gsm8k}
CONFIG=ppo_trainer
[ "${ENGINE:-fsdp}" = megatron ] && CONFIG=ppo_megatron_trainer
python3 -m verl.trainer.main_ppo --config-name "$CONFIG" \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    data.train_files="$DATA/train.parquet" \
    data.val_files="$DATA/test.parquet" \
    data.train_batch_size=64 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.external_lib=grpo_kernels.verl \
    actor_rollout_ref.model.use_fused_kernels=True \
    actor_rollout_ref.model.fused_kernel_options.impl_backend=triton \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 \
    trainer.logger='["console"]' \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.total_epochs=1 \
    "$@"
