#!/usr/bin/env bash
# GPU checks of `memplan run --device cuda` on a machine with an NVIDIA GPU
# (issue 15's GPU targets). Usage, from the repository root:
#
#   cargo build --release --features cuda --bin memplan
#   scripts/gpu_check.sh [MEMPLAN_BINARY] [OUT_DIR]
#
# On a lent machine with no Rust toolchain, build here with
# scripts/gpu_bundle.sh and carry .gpu/ (its header has the device call):
# the binary defaults to .gpu/memplan and memplan.torch's extension to
# .gpu/_memplan.abi3.so when they are there.
#
# It finds cuBLAS/NVRTC (a CUDA toolkit, or the nvidia-* wheels PyTorch
# installs) for LD_LIBRARY_PATH, runs the built-in GPT-2 tiny and small steps
# on CUDA with --compare-cpu (CUDA losses and final parameters against the
# CPU executor), and, when python3 has torch with CUDA, the same GPT-2 small
# step in PyTorch eager (tools/torch_eager_gpt2.py) for peak memory and step
# time side by side; the same for a Llama 3 1B step (f32 and mixed
# precision, tools/torch_eager_llama.py); then memplan.torch's arena step
# against eager PyTorch (python -m benchmarks.bench --device cuda). Logs
# and JSON go to OUT_DIR (default gpu-check/).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/release/memplan}
[ -z "${1:-}" ] && [ -x .gpu/memplan ] && BIN=.gpu/memplan
OUT=${2:-gpu-check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

# Library directories (never a toolkit's stubs/: its libcuda.so is a stub
# that fails every call with CUDA_ERROR_STUB_LIBRARY).
libdirs=$(find / \( -path /proc -o -path /sys \) -prune -o \
  \( -name 'libcublas.so*' -o -name 'libnvrtc.so*' -o -name 'libnccl.so*' -o -name 'libcublasLt.so*' \) \
  -print 2>/dev/null | grep -v /stubs/ | xargs -r -n1 dirname | sort -u | tr '\n' ':')
# cudarc looks for libnccl.so (or .so.<CUDA major>); NCCL's wheel has only
# libnccl.so.2, so a link to it goes first on the path.
links=$(mktemp -d)
nccl=$(find / \( -path /proc -o -path /sys \) -prune -o -name 'libnccl.so.2' -print 2>/dev/null | head -1)
[ -n "$nccl" ] && ln -s "$nccl" "$links/libnccl.so"
export LD_LIBRARY_PATH="${links}:${libdirs}${LD_LIBRARY_PATH:-}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

run() { # name, then memplan arguments
  local name=$1; shift
  echo "== memplan $*"
  /usr/bin/time -v "$BIN" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
  local rc=$?
  case "$*" in
    *--json*) grep -E '"(arena_bytes|workspace_bytes|lower_bound_bytes|median_step_seconds|measured_peak_bytes)"' "$OUT/$name.out" | sort | uniq -c ;;
    *) cat "$OUT/$name.out" ;;
  esac
  grep -v "^\s" "$OUT/$name.err" | tail -5
  grep "Maximum resident" "$OUT/$name.err"
  echo "exit $rc"
}


explicit() {
  # Correctness against the CPU executor, planned and unplanned, with
  # checkpointing and gradient clipping.
  run tiny_cuda run --example gpt2-tiny --device cuda --steps 3 --compare-cpu
  run tiny_cuda_unplanned run --example gpt2-tiny --device cuda --steps 3 --compare-cpu --unplanned
  run tiny_cuda_ckpt run --example gpt2-tiny --device cuda --steps 3 --compare-cpu --checkpoint
  run tiny_cuda_clip run --example gpt2-tiny --device cuda --steps 3 --compare-cpu --clip-grad-norm 1.0
  run small_cuda_cmp run --example gpt2-small --device cuda --steps 2 --compare-cpu
  # A world larger than the machine's GPUs must fail at once, naming why.
  run tiny_cuda_w2 run --example gpt2-tiny --device cuda --world-size 2 --steps 1
  # Peak and step time next to PyTorch eager on the same configuration.
  run small_cuda run --example gpt2-small --device cuda --steps 10 --json
  run xl_cuda run --example gpt2-xl --device cuda --steps 5 --json
}

fused() {
  # The flash-attention kernels against the CPU executor (sequence 100:
  # blocks and tiles end part-way), then peak and time.
  run tiny_fused_cmp run --example gpt2-tiny --fused-attention --seq 100 --device cuda --steps 3 --compare-cpu --checkpoint
  run small_fused_cmp run --example gpt2-small --fused-attention --device cuda --steps 2 --compare-cpu
  run small_fused_cuda run --example gpt2-small --fused-attention --device cuda --steps 10 --json
  run xl_fused_cuda run --example gpt2-xl --fused-attention --device cuda --steps 5 --json
  run small_fused_profile run --example gpt2-small --fused-attention --device cuda --steps 3 --profile
  # The same attention as cuBLAS products over blocks of query rows.
  run tiny_fused_gemm_cmp run --example gpt2-tiny --fused-attention --seq 100 --device cuda --steps 3 --compare-cpu --attention gemm
  run small_fused_gemm_cuda run --example gpt2-small --fused-attention --device cuda --steps 10 --json --attention gemm
  run small_fused_gemm_profile run --example gpt2-small --fused-attention --device cuda --steps 3 --profile --attention gemm
}

llama() {
  # Llama (RMSNorm, RoPE, grouped-query fused attention, SwiGLU) in f32 and
  # in mixed precision (bf16 kernels, bf16 gemmEx, casts) against the CPU
  # executor, then peak and time next to PyTorch eager
  # (tools/torch_eager_llama.py).
  run llama_tiny_cmp run --example llama-tiny --device cuda --steps 3 --compare-cpu
  run llama_tiny_bf16_cmp run --example llama-tiny --mixed-precision --device cuda --steps 3 --compare-cpu
  run llama_tiny_bf16_ckpt_cmp run --example llama-tiny --mixed-precision --checkpoint --device cuda --steps 3 --compare-cpu
  run gpt2_tiny_bf16_cmp run --example gpt2-tiny --mixed-precision --device cuda --steps 3 --compare-cpu
  # A step with recomputed ops (`fit --max-added`: the smallest within 1%
  # more FLOPs) against the CPU executor.
  echo "== memplan fit --example llama-tiny --mixed-precision --max-added 1% --minimise flops"
  "$BIN" fit --example llama-tiny --mixed-precision --max-added 1% --minimise flops --time-limit 10 \
    --output-graph "$OUT/llama_tiny_fit.json" 2>&1 | tee "$OUT/llama_tiny_fit.txt"
  run llama_tiny_fit_cmp run "$OUT/llama_tiny_fit.json" --device cuda --steps 3 --compare-cpu
  run llama_1b_cuda run --example llama3-1b --seq 1024 --device cuda --steps 5 --json
  # Mixed precision with the default attention (auto: the tensor-core
  # flash kernels on compute capability 8.0 or later).
  run llama_1b_bf16_cuda run --example llama3-1b --seq 1024 --mixed-precision --device cuda --steps 5 --json
  run llama_1b_bf16_flash_cuda run --example llama3-1b --seq 1024 --mixed-precision --device cuda --steps 5 --json --attention flash
  # Where the time goes, by kernel (two timing events per instruction).
  run llama_1b_bf16_profile run --example llama3-1b --seq 1024 --mixed-precision --device cuda --steps 3 --profile
  run llama_1b_profile run --example llama3-1b --seq 1024 --device cuda --steps 3 --profile
  # Fused attention as cuBLAS products (--attention gemm): correctness, then
  # peak, time and profile of the same Llama 3.2 1B steps.
  run llama_tiny_gemm_cmp run --example llama-tiny --device cuda --steps 3 --compare-cpu --attention gemm
  run llama_tiny_bf16_gemm_cmp run --example llama-tiny --mixed-precision --device cuda --steps 3 --compare-cpu --attention gemm
  run llama_1b_gemm_cuda run --example llama3-1b --seq 1024 --device cuda --steps 5 --json --attention gemm
  run llama_1b_bf16_gemm_cuda run --example llama3-1b --seq 1024 --mixed-precision --device cuda --steps 5 --json --attention gemm
  run llama_1b_bf16_gemm_profile run --example llama3-1b --seq 1024 --mixed-precision --device cuda --steps 3 --profile --attention gemm
  # The flash kernels on the tensor cores (--attention tensor-cores: bf16
  # attention, head dimension a multiple of 16 up to 128): correctness (a sequence of 100 ends
  # part-way through a 64-row block), then peak, time and profile.
  run llama_tiny_bf16_tc_cmp run --example llama-tiny --mixed-precision --seq 100 --device cuda --steps 3 --compare-cpu --attention tensor-cores
  # Head dimension 128 (the kernels' larger instantiation): one layer of
  # Llama 2 7B, one step (the second step's loss is near 0 on the fixed
  # batch, too small to compare).
  run llama2_7b_l1_bf16_tc_cmp run --example llama2-7b --layers 1 --seq 256 --mixed-precision --device cuda --steps 1 --compare-cpu --attention tensor-cores
  run llama_1b_bf16_tc_profile run --example llama3-1b --seq 1024 --mixed-precision --device cuda --steps 3 --profile --attention tensor-cores
}

torch_side() {
  if python3 -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    for cfg in small xl; do
      if [ -s "$OUT/${cfg}_cuda.out" ]; then
        echo "== PyTorch eager, gpt2-$cfg"
        python3 tools/torch_eager_gpt2.py --config gpt2-$cfg --steps 10 --memplan "$OUT/${cfg}_cuda.out" 2>&1 | tee "$OUT/torch_$cfg.out"
      fi
      if [ -s "$OUT/${cfg}_fused_cuda.out" ]; then
        echo "== PyTorch eager, gpt2-$cfg, fused attention (sdpa) vs memplan --fused-attention"
        python3 tools/torch_eager_gpt2.py --config gpt2-$cfg --steps 10 --sdpa --memplan "$OUT/${cfg}_fused_cuda.out" 2>&1 | tee "$OUT/torch_${cfg}_sdpa.out"
      fi
    done
    if [ -s "$OUT/llama_1b_cuda.out" ]; then
      echo "== PyTorch eager, llama3-1b seq 1024, f32"
      python3 tools/torch_eager_llama.py --config llama3-1b --seq 1024 --steps 5 \
        --memplan "$OUT/llama_1b_cuda.out" 2>&1 | tee "$OUT/torch_llama_1b.out"
    fi
    if [ -s "$OUT/llama_1b_bf16_cuda.out" ]; then
      # One eager run against each lowering of memplan's fused attention
      # that ran (auto, flash, gemm).
      local runs=()
      for f in llama_1b_bf16_cuda llama_1b_bf16_flash_cuda llama_1b_bf16_gemm_cuda; do
        [ -s "$OUT/$f.out" ] && runs+=(--memplan "$OUT/$f.out")
      done
      echo "== PyTorch eager, llama3-1b seq 1024, bf16 autocast over f32 parameters"
      python3 tools/torch_eager_llama.py --config llama3-1b --seq 1024 --steps 5 --mixed-precision \
        "${runs[@]}" 2>&1 | tee "$OUT/torch_llama_1b_bf16.out"
    fi
  else
    echo "python3 has no CUDA torch: skipping the PyTorch eager side"
  fi
}

# Whether python3 has torch with CUDA; if so, puts memplan.torch's
# extension in place: from .gpu/ (gpu_bundle.sh), or built with cargo (no
# maturin needed; HiGHS off, so no cmake either). Found through PYTHONPATH.
torch_ready() {
  if ! python3 -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "python3 has no CUDA torch: skipping memplan.torch on the GPU"
    return 1
  fi
  if [ -f .gpu/_memplan.abi3.so ]; then
    cp .gpu/_memplan.abi3.so python/memplan/_memplan.abi3.so
  else
    cargo build --release -p memplan-python --no-default-features \
      && cp target/release/lib_memplan.so python/memplan/_memplan.abi3.so
  fi
}

torch_step() {
  # memplan.torch's arena step against eager PyTorch on the GPU, from the
  # same weights (issue 12's GPU targets): max_memory_allocated/reserved,
  # step time, results.
  torch_ready || return
  local xl=
  python3 -c 'import transformers' 2>/dev/null && xl=--with-gpt2-xl
  echo "== python3 -m benchmarks.bench --device cuda --steps 5 $xl"
  PYTHONPATH=python python3 -m benchmarks.bench --device cuda --steps 5 $xl \
    --json "$OUT/torch_step.json" 2>&1 | tee "$OUT/torch_step.out"
  # The same models with eager in single-tensor arithmetic and cuDNN
  # deterministic on both sides: any difference left is memplan's.
  echo "== python3 -m benchmarks.bench --device cuda --exact --steps 3"
  PYTHONPATH=python python3 -m benchmarks.bench --device cuda --exact --steps 3 \
    --json "$OUT/torch_step_exact.json" 2>&1 | tee "$OUT/torch_step_exact.out"
  # Width-32 decoders: the replay's per-op overhead against eager's
  # launches.
  echo "== python3 -m benchmarks.bench --device cuda --tiny --steps 50"
  PYTHONPATH=python python3 -m benchmarks.bench --device cuda --tiny --steps 50 \
    --json "$OUT/torch_step_tiny.json" 2>&1 | tee "$OUT/torch_step_tiny.out"
  # Mixed precision as users write it: bf16 autocast, f32 master weights.
  echo "== python3 -m benchmarks.bench --device cuda --autocast --steps 5"
  PYTHONPATH=python python3 -m benchmarks.bench --device cuda --autocast --steps 5 \
    --json "$OUT/torch_step_bf16.json" 2>&1 | tee "$OUT/torch_step_bf16.out"
}

torch_step_loops() {
  # The same comparison for training loops as people write them (a second
  # call: each call has 10 minutes).
  torch_ready || return
  local xl=
  python3 -c 'import transformers' 2>/dev/null && xl=--with-gpt2-xl
  # Training as Hugging Face's Trainer runs it by default: dropout at 0.1
  # (native_dropout and SDPA with dropout on CUDA; eager and memplan draw
  # the same masks) and gradients clipped to norm 1.0 (foreach kernels).
  echo "== python3 -m benchmarks.bench --device cuda --dropout 0.1 --clip-grad-norm 1.0 --steps 5"
  PYTHONPATH=python python3 -m benchmarks.bench --device cuda --dropout 0.1 --clip-grad-norm 1.0 --steps 5 \
    --json "$OUT/torch_step_dropout.json" 2>&1 | tee "$OUT/torch_step_dropout.out"
  # AdamW(fused=True) on both sides: eager's fused kernel, memplan's
  # single-tensor update with its step counters on the GPU.
  echo "== python3 -m benchmarks.bench --device cuda --fused-optimizer --steps 5"
  PYTHONPATH=python python3 -m benchmarks.bench --device cuda --fused-optimizer --steps 5 \
    --json "$OUT/torch_step_fused.json" 2>&1 | tee "$OUT/torch_step_fused.out"
  # The same with cheap recomputation: at most 0.01% more FLOPs.
  echo "== python3 -m benchmarks.bench --device cuda --steps 5 $xl --max-added 0.0001"
  PYTHONPATH=python python3 -m benchmarks.bench --device cuda --steps 5 $xl --max-added 0.0001 \
    --json "$OUT/torch_step_fit.json" 2>&1 | tee "$OUT/torch_step_fit.out"
}

torch_step_precision() {
  # Float16 training and another optimizer (a third call).
  torch_ready || return
  # Float16 training with a GradScaler on both sides (cudnn batch norm,
  # the unscale kernels, updates skipped on overflow).
  echo "== python3 -m benchmarks.bench --device cuda --fp16 --clip-grad-norm 1.0 --steps 5"
  PYTHONPATH=python python3 -m benchmarks.bench --device cuda --fp16 --clip-grad-norm 1.0 --steps 5 \
    --json "$OUT/torch_step_fp16.json" 2>&1 | tee "$OUT/torch_step_fp16.out"
  # Adafactor (its norms as float64 tensors on the GPU; eager runs its
  # foreach kernels there, so the two agree to rounding).
  echo "== python3 -m benchmarks.bench --device cuda --optimizer adafactor --steps 3"
  PYTHONPATH=python python3 -m benchmarks.bench --device cuda --optimizer adafactor --steps 3 \
    --json "$OUT/torch_step_adafactor.json" 2>&1 | tee "$OUT/torch_step_adafactor.out"
}

torch_step_graph() {
  # The arena step launched as one CUDA graph (step(batch, graph=True);
  # both sides' AdamW capturable=True): the small models, bit for bit
  # with --exact, the tiny decoders, dropout with clipping, bf16 autocast,
  # then GPT-2 XL (about 3 minutes on an H200).
  torch_ready || return
  local xl=
  python3 -c 'import transformers' 2>/dev/null && xl=--with-gpt2-xl
  local i=0 name
  for args in "--steps 5" "--exact --steps 3" "--tiny --steps 20" "--dropout 0.1 --clip-grad-norm 1.0 --steps 5" \
      "--autocast --steps 5"; do
    i=$((i + 1)) name=torch_graph_$i
    echo "== python3 -m benchmarks.bench --device cuda --cuda-graph $args"
    PYTHONPATH=python python3 -m benchmarks.bench --device cuda --cuda-graph $args \
      --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.out"
  done
  if [ -n "$xl" ]; then
    echo "== GPT-2 XL b1 as one CUDA graph"
    PYTHONPATH=python python3 -c "
import json
from benchmarks import bench
rows = bench.on_device('cuda', 5, 10.0, bench._gpt2_xl_case('cuda'), graph=True)
bench._print_device_rows(rows)
json.dump(rows, open('$OUT/torch_graph_xl.json', 'w'), indent=1)" 2>&1 | tee "$OUT/torch_graph_xl.out"
  fi
}

split_cuda() {
  # Issue 40: steps whose loss chain is split into chunks (--split),
  # on the CUDA executor against the CPU executor (MatmulTnAccumulate's
  # lowering), then Llama 3.2 1B's shape at seq 1024 split and unsplit.
  run split_llama_tiny_cmp run --example llama-tiny --split 4 --device cuda --steps 3 --compare-cpu
  run split_llama_tiny_bf16_cmp run --example llama-tiny --mixed-precision --split 4 --device cuda --steps 3 --compare-cpu
  run split_gpt2_tiny_cmp run --example gpt2-tiny --split 3 --device cuda --steps 3 --compare-cpu
  # MLP regions too (src/split/rows.rs): forward, recomputed and backward
  # SwiGLU MLPs of a checkpointed step in row chunks.
  run split_llama_tiny_ckpt_cmp run --example llama-tiny --checkpoint --mixed-precision --split 4 --device cuda --steps 3 --compare-cpu
  run split_llama_1b_16k run --example llama3-1b --seq 16384 --mixed-precision --checkpoint --split 16 --device cuda --steps 3 --json --time-limit 10
  run unsplit_llama_1b_16k run --example llama3-1b --seq 16384 --mixed-precision --checkpoint --device cuda --steps 3 --json --time-limit 10
  run split_llama_1b_bf16 run --example llama3-1b --seq 1024 --mixed-precision --split 8 --device cuda --steps 3 --json --time-limit 5
  run unsplit_llama_1b_bf16 run --example llama3-1b --seq 1024 --mixed-precision --device cuda --steps 3 --json --time-limit 5
}

fsdp_nccl() {
  # Issue 37: memplan.torch's captured FSDP2 step with NCCL against FSDP2
  # eager: Llama 3.2 1B's shape (HF config, random weights, tied
  # embeddings), torchtitan's mixed precision, one rank (the machine has
  # one GPU), expandable segments off and on; then, where NCCL is 2.30 or
  # newer, two ranks on the one GPU (NCCL_MULTI_RANK_GPU_ENABLE=1) through
  # this path and through memplan's own executor.
  torch_ready || return
  local l1b="--layers 16 --hidden 2048 --intermediate 8192 --heads 32 --kv-heads 8 --vocab 128256 --tied --seq 2048"
  for conf in "" "expandable_segments:True"; do
    echo "== PYTORCH_CUDA_ALLOC_CONF=$conf python3 -m benchmarks.bench_distributed --device cuda --world 1 --fsdp --mixed-precision --arena $l1b"
    PYTORCH_CUDA_ALLOC_CONF=$conf PYTHONPATH=python timeout 240 python3 -m benchmarks.bench_distributed --device cuda \
      --world 1 --fsdp --mixed-precision --arena $l1b --batch 1 --time-limit 5 --timeout 230 2>&1 \
      | grep -v "^USDT\|gpuGetDeviceCount" | tee -a "$OUT/fsdp_nccl.out"
  done
  local v
  v=$(python3 -c 'import torch; print("%d.%d.%d" % torch.cuda.nccl.version())' 2>&1)
  echo "NCCL $v"
  if python3 -c 'import torch,sys; sys.exit(0 if torch.cuda.nccl.version() >= (2, 30, 0) else 1)'; then
    echo "== NCCL_MULTI_RANK_GPU_ENABLE=1 python3 -m benchmarks.bench_distributed --device cuda --world 2 --fsdp"
    NCCL_MULTI_RANK_GPU_ENABLE=1 PYTHONPATH=python timeout 150 python3 -m benchmarks.bench_distributed --device cuda \
      --world 2 --fsdp --layers 4 --hidden 1024 --seq 1024 --time-limit 5 --timeout 140 2>&1 \
      | grep -v "^USDT\|gpuGetDeviceCount" | tee -a "$OUT/fsdp_nccl.out"
    NCCL_MULTI_RANK_GPU_ENABLE=1 run w2_shared_cuda run --example gpt2-tiny --device cuda --world-size 2 --steps 3
    run w2_cpu run --example gpt2-tiny --world-size 2 --steps 3
  fi
}

baselines_gpu() {
  # Issue 39: the eager configurations a knowledgeable user runs, each in
  # its own process with expandable segments off and on, against memplan,
  # then the largest batch in 12 GiB and its tokens per second.
  torch_ready || return
  echo "== python3 -m benchmarks.bench_baselines --device cuda --models hf-llama --size medium --batch 4 --seq 1024 --compile --cap 12288"
  PYTHONPATH=python python3 -m benchmarks.bench_baselines --device cuda --models hf-llama --size medium \
    --batch 4 --seq 1024 --steps 3 --time-limit 4 --compile --cap 12288 --json \
    > "$OUT/baselines.json" 2> >(grep -v "^USDT\|gpuGetDeviceCount" | tee "$OUT/baselines.log" >&2)
}

split_liger() {
  # Issue 40: Llama 3.2 1B's shape (tied), bf16 autocast, seq 4096, batch
  # 1: eager with Hugging Face's loss, with Liger-Kernel's fused linear
  # cross-entropy (the liger-kernel wheel carried in .whl/ and installed
  # on PYTHONPATH), with torchtune's chunked loss, and memplan's split step
  # in its arena (SPLIT_CHUNKS chunks, default 16).
  torch_ready || return
  echo "== python3 -m benchmarks.bench_split_device --tied --bf16 --chunks ${SPLIT_CHUNKS:-16}"
  PYTHONPATH=python${PYTHONPATH:+:$PYTHONPATH} timeout ${SPLIT_S:-220} python3 -m benchmarks.bench_split_device \
    --tied --bf16 --chunks ${SPLIT_CHUNKS:-16} --time-limit 5 --steps 3 --json "$OUT/split_liger.json" 2>&1 \
    | grep -v "^USDT\|gpuGetDeviceCount" > "$OUT/split_liger.out"
  head -8 "$OUT/split_liger.out"
}

baselines_cap() {
  # Issue 39: the largest batch within a cap (CAP_GIB, default 12) and its
  # tokens per second, for the sides in CAP_SIDES (default: memplan's plan
  # and its fit at 0.1%, selective checkpointing with the optimizer in the
  # backward (the strongest eager side that adds no matrix-product FLOPs),
  # then the two eager sides the 2026-11-27 run did not reach), each in its
  # own process stopped after CAP_SIDE_S seconds (default 150; memplan's
  # side at the 1b size took 226 s on an H200 on 2026-12-04, a capture and
  # plan of the 1.24B-parameter step per batch tried: give it 300 there).
  # The model: CAP_MODEL (hf-llama or hf-gpt2) at CAP_SIZE (bench_baselines'
  # sizes; default medium: 8 layers, hidden 1024), seq CAP_SEQ (1024),
  # batches up to CAP_UPTO (16), bf16 autocast with CAP_BF16=1. Issue 39's
  # targets: CAP_GIB=40 CAP_SIZE=1b CAP_SEQ=2048 CAP_BF16=1 CAP_UPTO=64
  # (Llama 3.2 1B's shape), then CAP_MODEL=hf-gpt2 without CAP_BF16
  # (GPT-2 XL, f32).
  torch_ready || return
  local sides=${CAP_SIDES:-memplan,memplan-fit-0.1%,eager-selective-ac+optimizer-in-backward,eager-selective-ac,eager-optimizer-in-backward}
  echo "== largest batch within ${CAP_GIB:-12} GiB: ${CAP_MODEL:-hf-llama} ${CAP_SIZE:-medium} seq ${CAP_SEQ:-1024} bf16 ${CAP_BF16:-0}: $sides"
  PYTHONPATH=python python3 -c "
import json, sys
from benchmarks import bench_baselines_device as d
base = dict(model='${CAP_MODEL:-hf-llama}', size='${CAP_SIZE:-medium}', seq=int('${CAP_SEQ:-1024}'), steps=3,
            time_limit=4.0, device='cuda', cap_bytes=int(float('${CAP_GIB:-12}') * 2 ** 30),
            upto=int('${CAP_UPTO:-16}'), bf16=bool('${CAP_BF16:-}'))
out = {'cap_bytes': base['cap_bytes'], 'spec': base}
for side in '$sides'.split(','):
    name, conf = (side, '') if side in d.MEMPLAN_SIDES else (side + '+expandable', d.EXPANDABLE)
    out[name] = d.spawn(dict(base, side=side), conf, timeout=float('${CAP_SIDE_S:-150}'))
    print(d._line(name, out[name]), flush=True)
    json.dump(out, open('$OUT/cap.json', 'w'), indent=1)
" 2>&1 | grep -v "^USDT\\|gpuGetDeviceCount" | tee "$OUT/cap.log"
}

# SECTIONS picks what runs (default: all).
for section in ${SECTIONS:-explicit fused llama torch_side torch_step torch_step_loops torch_step_precision torch_step_graph}; do
  "$section"
done
