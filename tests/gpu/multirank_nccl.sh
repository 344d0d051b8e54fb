#!/usr/bin/env bash
# Multi-rank replay tests under NCCL on GPUs: the layouts the CPU suite cannot run.
#
#     bash tests/gpu/multirank_nccl.sh            # from the repository root
#
# Needs a machine with at least 2 CUDA GPUs (4 for pipeline 2 x data parallel 2),
# torch_r3 installed with megatron-core, and Transformer Engine (context
# parallelism and the packed THD layout run only on its attention; Megatron's
# local DotProductAttention asserts context_parallel_size == 1 and
# packed_seq_params is None). It runs tests/megatron/test_multirank.py with
# TORCH_R3_TEST_BACKEND=nccl: every layout there (data parallel 2, tensor
# parallel 2 with sequence parallelism, pipeline 2 x data parallel 2 with
# recompute, context parallel 2 padded and packed) in bf16 on Transformer
# Engine's layer spec, each against a single-process run of the same weights
# and samples. Layouts that need more GPUs than the machine has are skipped with
# the reason. Extra arguments go to pytest (for example -k context_parallel).
set -euo pipefail
cd "$(dirname "$0")/../.."
gpus=$("${PYTHON:-python}" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 2 ]; then
    echo "error: $gpus CUDA GPU(s) visible; these tests need at least 2" >&2
    exit 2
fi
TORCH_R3_TEST_BACKEND=nccl exec "${PYTHON:-python}" -m pytest tests/megatron/test_multirank.py -v -rs -p no:cacheprovider "$@"
