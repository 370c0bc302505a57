#!/usr/bin/env bash
# The whole GPU batch in one call, on a machine with a CUDA GPU and its own torch/triton/transformers:
# installs what that machine lacks from wheels carried in .whl/ (pytest, gguf, grpcio-tools for the build),
# installs rtx-serve in editable mode without touching its torch, then runs
#   tests   the Triton kernel tests at real shapes on the GPU
#   checks  greedy GPU == CPU on the default model's shape, and where a decode step's time goes
#   sweep   launch shapes of the decode-attention kernel, and the GEMV kernel against cuBLAS, timed
#   splits  the decode-attention kernel's sequence splits at W2-like contexts, timed
#   layers  the decode-attention kernel's launch shapes at W2-like contexts, 16 layers' caches in one CUDA graph
#   mixed   where a continuous-batching step with a newcomer's prefill goes (ops, prefill-attention shapes, engine
#           steps, and how busy the GPU is during W2 at 64 running)
#   bench   rtx bench on W3, W1, W2 (llama-1b) and W1, W8B (llama-8b), each with its baseline in the same run
#   w1, w3  W1 or W3 alone;  cb  continuous versus static batching on W2 at 16, 32 and 64 running at most
#   host    where the host's time goes per step (cProfile), one stream and W2
#   host64  the same for W2 at 64 running
#   decode  greedy GPU == CPU and decode step times, with programmatic dependent launch (RTX_PDL=1) and without
#   w3ab    W3 four times, alternately without and with programmatic dependent launch (no HF baseline)
#   cb64ab  continuous versus static batching on W2 at 64 running: as built, without the attention launch cache
#           (RTX_LAUNCH_CACHE=0), and without that and programmatic dependent launch (RTX_PDL=0)
#   cb64before  continuous versus static batching on W2 at 64 running, $RUNS times each (default 2), alternately
#           with the tree as it is and with the files under $BEFORE (same relative paths: those files as they were
#           before a change) in their place; the tree is restored afterwards
#   quantsweepbefore, int4w3before  the same alternation for the quantized kernels at $ROWS rows of x (default one
#           and four; quant_sweep.py), and for int4's W3 against bf16's, five runs each (quant_speed.py)
#   greedy  greedy GPU == CPU only;  attn  the attention kernel tests only
#   quant   quantized weights: quantkernels, then quantspeed
#   quantkernels  the W8A16/W4A16 and fp8 activation kernel tests, and the kernels against cuBLAS bf16 at llama-8b
#           shapes
#   quantspeed    W3 and W1 on llama-8b for bf16, int8, int4 and fp8 in one run (benchmarks/quant_speed.py)
#   install       nothing more than the install every call starts with (for commands run by hand afterwards; with
#                 wheels in .whl/, under PYTHONPATH=/tmp/site)
#   quanttests    the quantized kernel tests and int8-sq's tests alone
#   quantconfigs  every GEMV launch configuration of a grid at one row of x (quant_sweep.py --configs)
#   quantw3       W3 on llama-8b for bf16, int4, int8 and int8-sq, the median of three runs each
#   int4mma       the quantized kernel tests (tensor-core GEMV among them) and int8-sq's, then the kernels at 1, 2, 4
#                 and 8 rows of x, int4's tensor-core GEMV beside its FMA GEMV and cuBLAS (quant_sweep.py)
#   int4ncu       int4's GEMVs at one row beside a kernel that only reads the same bytes (gemv_profile.py), the same
#                 under Nsight Compute (report in $OUT), and the kernels of llama-8b's decode step at batch 1, int4
#                 and bf16, eager (gpu_profile.py)
#   w3attn  W3's decode attention on llama-8b: every split count at contexts 128, 256 and 384, one graph over
#           enough layers' caches to fill twice the L2 (kernel_sweep.py --w3)
#   kvtests the KV tier tests, among them the one that fails if offload waits for the GPU
#   w4tiers W4 with KV tiers (benchmarks/w4_tiers.py) on llama-1b: hit rate and p99 at 1.5x load, device cache
#           with room for everything, too small with a host tier under it, too small without
# Usage: benchmarks/gpu_bench.sh [tests] [checks] [sweep] [splits] [layers] [mixed] [bench] [w1] [w3] [cb] [host]
#        [bench8b] [host64] [decode] [w3ab] [cb64ab] [cb64before] [quantsweepbefore] [int4w3before]
#        [greedy] [attn] [w4tiers] [quant] [quantkernels]
#        [quantspeed] [install] [quanttests] [quantconfigs] [quantw3] [int4mma] [int4ncu] [w3attn] [kvtests]
#        (default: tests checks bench bench8b); results go to $OUT (or ./gpu-out)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
RTX=$(command -v rtx || echo "python3 -m rtxcore.cli.main")
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"

llama1b=(--model dummy:llama-1b --max-num-batched-tokens 8192 --max-model-len 4096)

# before_and_after CMD: CMD TAG, $RUNS times each (default 2), alternately with the tree as it is (TAG after_1, ...)
# and with the files under $BEFORE (same relative paths: those files as they were before a change) in their place
# (before_1, ...). A file of $BEFORE that the tree lacks is removed again after its run, and the tree is restored
# after each run, also when the script is interrupted. The install is editable: the source is what runs.
before_and_after() {
  [ -d "${BEFORE:-}" ] || { echo "$1 before/after: set BEFORE to a folder of the files as they were" >&2; exit 2; }
  [[ ${RUNS:-2} =~ ^[1-9][0-9]*$ ]] || { echo "RUNS must be a positive count, got '$RUNS'" >&2; exit 2; }
  local saved rc=0 run which
  saved=$(mktemp -d)
  (cd "$BEFORE" && find . -type f) >"$saved.list"
  while read -r f; do
    if [ -e "$f" ]; then mkdir -p "$saved/$(dirname "$f")" && cp "$f" "$saved/$f"; else echo "$f" >>"$saved.absent"; fi
  done <"$saved.list"
  restore() {
    cp -r "$saved"/. .
    [ -f "$saved.absent" ] && while read -r f; do rm -f "$f"; done <"$saved.absent"
    return 0
  }
  for run in $(seq "${RUNS:-2}"); do
    for which in after before; do
      if [ $which = before ]; then
        trap 'restore; exit 130' INT TERM
        cp -r "$BEFORE"/. .
      fi
      echo "== $1, $which, run $run"
      "$1" "${which}_$run" || rc=1
      if [ $which = before ]; then
        restore
        trap - INT TERM
      fi
    done
  done
  return $rc
}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests checks bench bench8b)
status=0
for step in "${steps[@]}"; do
  case "$step" in
    tests)
      python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention.py tests/test_kernels_elementwise.py tests/test_kernels_gemv.py 2>&1 | tee "$OUT/kernel_tests.log" | tail -5
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    checks)
      python3 benchmarks/gpu_checks.py "$OUT/checks.json" 2>&1 | tee "$OUT/checks.log" || status=1 ;;
    sweep)
      python3 benchmarks/kernel_sweep.py 2>&1 | tee "$OUT/kernel_sweep.log" || status=1
      python3 benchmarks/gemv_sweep.py --splits 2>&1 | tee "$OUT/gemv_sweep.log" || status=1 ;;
    splits)
      python3 benchmarks/kernel_sweep.py --splits 2>&1 | tee "$OUT/splits_sweep.log" || status=1 ;;
    layers)
      python3 benchmarks/kernel_sweep.py --layers 2>&1 | tee "$OUT/layers_sweep.log" || status=1 ;;
    mixed)
      python3 benchmarks/gpu_mixed.py ops prefill steps busy 2>&1 | tee "$OUT/mixed.log" || status=1 ;;
    host)
      python3 benchmarks/host_profile.py 2>&1 | tee "$OUT/host_profile.log" || status=1 ;;
    host64)
      python3 benchmarks/host_profile.py w2_64 2>&1 | tee "$OUT/host_profile_64.log" || status=1 ;;
    decode)
      for pdl in 1 0; do
        RTX_PDL=$pdl python3 benchmarks/gpu_checks.py "$OUT/decode_pdl$pdl.json" decode 2>&1 | tee -a "$OUT/decode.log" \
          || status=1
      done ;;
    w3ab)
      for run in 1 2; do
        for pdl in 0 1; do
          echo "== W3, RTX_PDL=$pdl, run $run"
          RTX_PDL=$pdl $RTX bench --workload W3 "${llama1b[@]}" --json "$OUT/W3_llama1b_pdl${pdl}_$run.json" || status=1
        done
      done ;;
    cb64ab)
      for flags in "1 1" "1 0" "0 0"; do
        read -r pdl cache <<<"$flags"
        echo "== CB vs static, 64 running, RTX_PDL=$pdl RTX_LAUNCH_CACHE=$cache"
        RTX_PDL=$pdl RTX_LAUNCH_CACHE=$cache $RTX bench --workload W2 --baseline static "${llama1b[@]}" \
          --max-num-seqs 64 --json "$OUT/W2_llama1b_cb_vs_static_64_pdl${pdl}_cache$cache.json" || status=1
      done ;;
    cb64before)
      cb64() {
        $RTX bench --workload W2 --baseline static "${llama1b[@]}" --max-num-seqs 64 \
          --json "$OUT/W2_llama1b_cb_vs_static_64_$1.json"
      }
      before_and_after cb64 || status=1 ;;
    quantsweepbefore)
      quantsweep() {
        python3 benchmarks/quant_sweep.py "$OUT/quant_sweep_gemv_$1.json" --rows "${ROWS:-1,4}" \
          --shapes qkv,o_proj,gate_up,down_proj 2>&1 | tee "$OUT/quant_sweep_gemv_$1.log" | tail -42
      }
      before_and_after quantsweep || status=1 ;;
    int4w3before)
      int4w3() {
        python3 benchmarks/quant_speed.py --methods int4 --workloads W3 --repeats 5 \
          --json "$OUT/quant_speed_w3_$1.json" 2>&1 | tee "$OUT/quant_speed_w3_$1.log" | tail -5
      }
      before_and_after int4w3 || status=1 ;;
    w4tiers)
      python3 benchmarks/w4_tiers.py --model dummy:llama-1b --conversations 32 --turns 8 --new-tokens 64 \
        --reply-tokens 128 --max-num-seqs 16 --max-num-batched-tokens 2048 --json "$OUT/w4_tiers_llama1b.json" \
        2>&1 | tee "$OUT/w4_tiers.log"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    attn)
      python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention.py 2>&1 | tee "$OUT/attention_tests.log" | tail -5
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    greedy)
      python3 benchmarks/gpu_checks.py "$OUT/greedy.json" greedy 2>&1 | tee "$OUT/greedy.log" || status=1 ;;
    w1)
      $RTX bench --workload W1 --baseline hf "${llama1b[@]}" --json "$OUT/W1_llama1b.json" || status=1 ;;
    w3)
      $RTX bench --workload W3 --baseline hf "${llama1b[@]}" --json "$OUT/W3_llama1b.json" || status=1 ;;
    cb)
      for seqs in 16 32 64; do
        $RTX bench --workload W2 --baseline static "${llama1b[@]}" --max-num-seqs $seqs \
          --json "$OUT/W2_llama1b_cb_vs_static_$seqs.json" || status=1
      done ;;
    bench)
      common=("${llama1b[@]}")
      $RTX bench --workload W3 --baseline hf "${common[@]}" --json "$OUT/W3_llama1b.json" || status=1
      $RTX bench --workload W1 --baseline hf "${common[@]}" --json "$OUT/W1_llama1b.json" || status=1
      $RTX bench --workload W2 "${common[@]}" --json "$OUT/W2_llama1b.json" || status=1
      # Continuous versus static batching of the same requests on the same engine, 64 running at most.
      $RTX bench --workload W2 --baseline static "${common[@]}" --max-num-seqs 64 \
        --json "$OUT/W2_llama1b_cb_vs_static.json" || status=1 ;;
    quant|quantkernels)
      python3 -m pytest -q -p no:cacheprovider tests/test_kernels_quant.py tests/test_kernels_quant_rows.py 2>&1 | tee "$OUT/quant_kernel_tests.log" | tail -5
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      python3 benchmarks/quant_sweep.py "$OUT/quant_sweep.json" 2>&1 | tee "$OUT/quant_sweep.log" || status=1 ;;&
    quant|quantspeed)
      python3 benchmarks/quant_speed.py --json "$OUT/quant_speed.json" 2>&1 | tee "$OUT/quant_speed.log" || status=1 ;;
    quantkernels) ;;
    install) ;;
    quanttests)
      python3 -m pytest -q -p no:cacheprovider tests/test_kernels_quant.py tests/test_kernels_quant_rows.py \
        tests/test_quantizer_int8_sq.py 2>&1 | tee "$OUT/quant_tests.log" | tail -8
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    quantconfigs)
      python3 benchmarks/quant_sweep.py "$OUT/quant_configs.json" --configs --rows 1 \
        --shapes qkv,o_proj,gate_up,down_proj 2>&1 | tee "$OUT/quant_configs.log" | tail -12
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    quantw3)
      python3 benchmarks/quant_speed.py --methods int4,int8,int8-sq --workloads W3 --repeats 3 \
        --json "$OUT/quant_w3.json" 2>&1 | tee "$OUT/quant_w3.log" | tail -12
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    int4mma)
      python3 -m pytest -q -p no:cacheprovider tests/test_kernels_quant.py tests/test_kernels_quant_rows.py \
        tests/test_quantizer_int8_sq.py -k "not int8_linear_matches and not dequantized_matmul" 2>&1 \
        | tee "$OUT/quant_tests.log" | tail -8
      [ "${PIPESTATUS[0]}" -eq 0 ] || { status=1; continue; }  # no timings of wrong kernels
      python3 benchmarks/quant_sweep.py "$OUT/quant_sweep_mma.json" --rows 1,2,4,8 \
        --shapes qkv,o_proj,gate_up,down_proj 2>&1 | tee "$OUT/quant_sweep_mma.log" | tail -90
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    int4ncu)
      python3 benchmarks/gemv_profile.py 2>&1 | tee "$OUT/gemv_profile.log"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      if [ -n "$ncu" ]; then
        "$ncu" --clock-control none --profile-from-start off --set full -f -o "$OUT/gemv" \
          python3 benchmarks/gemv_profile.py --shapes gate_up --profile >"$OUT/ncu_run.log" 2>&1 || status=1
        "$ncu" --import "$OUT/gemv.ncu-rep" --page details >"$OUT/ncu_details.txt" 2>&1 || status=1
        grep -E "^  [a-z_]|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Block Limit" \
          "$OUT/ncu_details.txt" | head -80
      else
        echo "int4ncu: no ncu on this machine" >&2; status=1
      fi
      for q in int4 bf16; do
        quant=(); [ $q = bf16 ] || quant=(--quantization $q)
        python3 benchmarks/gpu_profile.py 1 --model dummy:llama-8b "${quant[@]}" >"$OUT/profile_8b_$q.log" 2>&1 \
          || { tail -5 "$OUT/profile_8b_$q.log"; status=1; }
      done ;;
    w3attn)
      python3 benchmarks/kernel_sweep.py --w3 2>&1 | tee "$OUT/w3_attention.log" | tail -30
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    kvtests)
      python3 -m pytest -q -p no:cacheprovider tests/test_kv_tiers.py 2>&1 | tee "$OUT/kv_tests.log" | tail -5
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    bench8b)
      common=(--model dummy:llama-8b --max-num-batched-tokens 8192 --max-model-len 4096)
      $RTX bench --workload W1 "${common[@]}" --json "$OUT/W1_llama8b.json" || status=1
      $RTX bench --workload W8B --baseline hf "${common[@]}" --json "$OUT/W8B_llama8b.json" || status=1 ;;
    *) echo "unknown step: $step" >&2; exit 2 ;;
  esac
done
exit $status
