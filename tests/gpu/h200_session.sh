#!/usr/bin/env bash
# One visit to the H200: run the named steps in order, each under a time limit, logging to $OUT.
#   bash tests/gpu/h200_session.sh env tests peers ch04 ch05 micro sanitize notebooks
#   (fa4_final, chapter 08: fa4-check fa4-bench fa4-ablation fa4-timeline (the chapter's three files);
#    fa4-knobs: the knobs in bursts; split-sanitize, dyn-sanitize: measure.fwd_checks under the sanitizers)
#   (fa4-gaps: the forward's knobs at the shapes where the FA4 package leads; fa4-sched: the
#    tile schedules (persistent or one tile per CTA, L2 sections) at all eight forward shapes;
#    fa4-split: the last round whole or cut along the keys at the four non-causal shapes;
#    split-check / split-sanitize: the split tail's float64 checks / under the sanitizers;
#    dyn-check / dyn-sanitize / clocked-dyn: the same for the dynamic tile scheduler, and its
#    time at the four causal shapes at the fixed clock;
#    fa4-d64: the exp2 emulation share and the rescale threshold at the four D = 64 shapes;
#    fa4-tune: tau = 8 at the eight shapes, each config settled at its own
#    clock first; fa4-bench-settled: the forward benchmark so;
#    clocked: fa4_final, two variants and the FA4 package at ncu's fixed clock, 8 shapes;
#    predecessors: one shape's burst timed after an idle pause, a slow kernel, the other
#    implementation, itself)
#   (chapter 11-12: bwd-check bwd-tests bwd-bench lse-fold-tests bwd-phases bwd-phases-flush api-tests ch12-sweep ch12-acc varlen-tests
#    api-varlen-tests (the API's GPU tests and the varlen backward's, without the training run)
#    varlen-bench varlen-sanitize varlen-bwd-sanitize; varlen-dyn-sanitize: the varlen
#    forward's dynamic tiles under memcheck, racecheck and synccheck)
#   (decode, decode-d64: measure.decode at D = 128 / 64: the decode kernel and the package
#    call beside the peers; decode-b32: the D = 128 grid at batch 32 only;
#    decode-tests: the split combine, the decode kernel and chapter 15's exercises against float64;
#    decode-sanitize / -racecheck / -synccheck: the paged and gathered decode kernel under the three sanitizers;
#    decode-paged16: measure.decode with pages of 16 keys, the gathered tiles;
#    decode-variants: measure.decode's config candidates (64-key tiles, two or four stages,
#    twice the splits) beside the default at batch 1 and 32, 1 and 4 tokens, 8k and 128k keys;
#    decode-boxes / decode-boxes-tests: the tile from boxes of 32 or 16 keys (and two stages)
#    beside the default and the peers / bit for bit the default and float64; decode-boxes-more:
#    boxes of 32 with two consumers (16 tokens, GQA 8) and at D = 64;
#    decode-keys-on-m-tests: the decode kernel with the keys on the wgmma M (swap_ab) against float64;
#    decode-two-consumers-tests: two consumer warpgroups, 128 packed rows a CTA, against float64;
#    decode-two-consumers-sanitize: one of its paged cases under synccheck, racecheck and memcheck;
#    decode-two-consumers-bench: measure.decode at 16 tokens, GQA 8 and 16, the wg2 row beside the default;
#    decode-bad-values-memcheck: bad page-table values launched before the check reads them,
#    under memcheck;
#    decode-cluster-tests / -sanitize / -bench: the pair of CTAs sharing each K/V tile by multicast
#    (HopperDecodeConfig.cluster = 2) against float64, under the three sanitizers, and timed as
#    the pair row at 16 tokens, GQA 16 and 8, beside the default and the peers)
#   (sdpa-tests: fa4_final registered as SDPA's flash implementation, a small transformer against
#    float64; softcap-tests: the softcap and learnable-sink builds against float64;
#    softcap-api-tests: both through the public API (FA4_FINAL_PENDING set), conformance-features: vs FA4;
#    headdim-tests: the forward at D = 96, 192, 256 and dv != D against float64, headdim-sanitize
#    two of its cases under memcheck; seqused-q-tests: varlen with seqused_q, padding untouched;
#    features: the forward at D = 96/192/256 and with softcap/sinks beside the peers;
#    bwd-headdim-tests / -d192 / -d192v192 / -d256: the backward at D = 96 / at D = 192, dv = 128 /
#    at D = dv = 192 / at D = 256 (the last two with dK, dV swapped) against float64;
#    features-bwd: the first two backwards beside the peers, features-bwd-swapped the last two;
#    bwd-swapped-sanitize: the last two's small fp16 case under memcheck, racecheck, synccheck;
#    softcap-headdim-tests: a softcap at head dims 96, 192, 256 and dv != D through the API,
#    dense and varlen, against float64 (their pass on an H100 lifted the softcap_head_dims row);
#    bwd-headdim-racecheck: the small fp16 case of each of the four builds under racecheck,
#    compiled with line info so a hazard names its source line (Note [Release after the
#    warp's reads]))
#   (host: the API's host time per call vs its kernels' time, with the peers; host-train: the
#    small-GPT training step, fa4_final vs SDPA)
#   (record: the logs of the test and sanitizer steps before it -> results/h200/gpu_checks.json)
#   (bwd-versus-profile: ncu on our backward main kernel and the FA4 package's at D = 128)
#   (profiles: ch04-profile, ch05-profile, fa4-profile, fa4-versus (fa4_final and the FA4
#    package side by side), fa4-stalls (the two, per SASS instruction); each keeps ncu's CSV
#    exports under $OUT/<name>_raw)
# (ch04-peers also needs CUTLASS_FA2_EXAMPLE: the path of CUTLASS's Ampere FA2 example)
# Results files written under results/ are sent back as $OUT/results.tar; logs as $OUT/logs.tar.gz.
# DEADLINE=<epoch seconds> shortens the last steps so that none runs past it (the logs of a
# command cut short stay under $OUT/logs).
# Needs the CuTe DSL staged and sourced (/tmp/dsl_env.sh) and COURSE_COMMIT set by the caller.
# tests/gpu/run_tree.sh runs it from a tree archived here and carried to the GPU machine.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 MPLBACKEND=Agg
PY=${PY:-python3}
SAN="compute-sanitizer --report-api-errors no --error-exitcode 9"
DECODE_ROWS="fa4_final_splits fa4_final_paged_splits fa4_final_decode fa4_final_decode_paged fa4_package fa4_package_splits fa4_package_paged sdpa_flash sdpa_cudnn"  # the decode grid's rows: ours with the heuristic's splits, the kernel, every peer
status=0

mdl() {  # mdl SECONDS: a measure's own --deadline, cut so that it ends 45 s before DEADLINE
  local d=$1
  if [ -n "${DEADLINE:-}" ]; then
    local left=$((DEADLINE - $(date +%s) - 45))
    [ $left -lt $d ] && d=$left
  fi
  [ $d -lt 10 ] && d=10
  echo $d
}

step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  if [ -n "${DEADLINE:-}" ]; then  # DEADLINE (epoch seconds): no step runs past it
    local left=$((DEADLINE - $(date +%s)))
    [ $left -lt $limit ] && limit=$left
    if [ $limit -lt 20 ]; then echo "=== $name: skipped, DEADLINE reached"; status=1; return; fi
  fi
  echo "=== $name (limit ${limit}s): $*"
  timeout --signal=KILL "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "    -> rc=$rc in $((SECONDS - t0))s"; tail -n "${TAIL:-15}" "$OUT/logs/$name.log" | sed 's/^/    /'
  [ $rc -eq 0 ] || status=1
}

for s in "$@"; do
  case $s in
    env) step env 60 bash -c "nvidia-smi; $PY -c 'import torch, cutlass; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'; which make compute-sanitizer ncu; $PY -m pip list 2>/dev/null | grep -i -E 'flash|quack|cutlass|nbval|ipykernel|pytest'" ;;
    tests) step gpu_tests 540 $PY -m pytest -q -m gpu -p no:cacheprovider --timeout=300 -rA ${GPU_TESTS:-tests/gpu} ;;
    peers) step peers 420 $PY -m measure.benchmark --name peers --seqlens 1024 4096 16384 --dims 64 128 --causal both --passes fwd bwd ;;
    versions) step ch01_ch02 300 $PY -m measure.benchmark --versions naive tiled_fa2 --name ch01_ch02_fwd --seqlens 1024 4096 16384 --dims 128 --causal no ;;
    ch04) step ch04_bench 420 $PY -m measure.benchmark --versions flash_ampere --name ch04_fwd --seqlens 4096 16384 --dims 64 128 --causal both ;;
    ch04-sweep) step ch04_sweep 420 $PY -m measure.ch04_sweep --check ;;
    ch04-peers) step ch04_peers 300 $PY -m measure.ch04_cutlass_peer --cutlass-example "${CUTLASS_FA2_EXAMPLE:?set CUTLASS_FA2_EXAMPLE to the path of flash_attention_v2.py from CUTLASS}" ;;
    ch05) step ch05_bench 420 $PY -m measure.benchmark --versions flash_hopper --name ch05_fwd --seqlens 4096 16384 --dims 64 128 --causal both ;;
    ch05-check) step ch05_check 600 $PY -m solutions.ch05_flash_hopper --check ;;
    ch05-knobs) step ch05_knobs 420 $PY -m measure.ch05_knobs ;;
    ch04-check) step ch04_check 600 $PY -m solutions.ch04_flash_ampere --check ;;
    ch04-profile) step ch04_profile 300 $PY -m measure.profile_ch04 --raw-dir "$OUT/ch04_profile_raw" ;;
    ch05-profile) step ch05_profile 300 $PY -m measure.profile_ch05 --raw-dir "$OUT/ch05_profile_raw" ;;
    fa4-profile) step fa4_profile 300 $PY -m measure.profile_fa4_final --raw-dir "$OUT/fa4_final_profile_raw" ;;
    fa4-boost) step fa4_boost 300 $PY -m measure.fwd_versus --boost 64 16384 1 --raw-dir "$OUT/fa4_final_versus_boost_raw" ;;
    fa4-stalls) step fa4_stalls 560 $PY -m measure.fwd_stalls --raw-dir "$OUT/fa4_final_stalls_raw" ;;
    fa4-versus) step fa4_versus 540 $PY -m measure.fwd_versus --raw-dir "$OUT/fa4_final_versus_raw" ;;
    ch07) step ch07_rescale 300 $PY -m measure.rescale_knob --save ;;
    fa4-check) step fa4_check 420 $PY -m measure.fwd_checks ;;
    bwd-check) step bwd_check 300 $PY -m solutions.ch11_bwd_check --small ;;
    bwd-tests) step bwd_tests 900 $PY -m pytest -q -m gpu -p no:cacheprovider -x -rA tests/gpu/test_fa4_final_bwd.py ;;
    bwd-bench) step bwd_bench 900 $PY -m measure.bwd_benchmark ;;
    bwd-bench-64-128) step bwd_bench_64_128 580 $PY -m measure.bwd_benchmark --dims 64 128 --rounds 5 --name bwd_bench --deadline $(mdl 450) ;;  # issue 34's table: D = 64 and 128, five rounds, the L2 flushed (bwd-phases gives the calls back to back)
    fwd-bwd-table) step fwd_bwd_table 580 $PY -m measure.bwd_benchmark --dims 64 128 --rounds 5 --passes fwd+bwd --name fwd_bwd_bench --deadline $(mdl 450) ;;  # issue 34's fwd+bwd row: a forward and its backward per call beside the peers, five rounds, the L2 flushed
    bwd-defaults) step bwd_defaults 580 $PY -m measure.bwd_phases --rounds 5 --dims 128 64 --impls fa4_final fa4_final_deterministic fa4_package --name bwd_phases_defaults ;;  # the backward as a call runs it (default, deterministic) beside the FA4 package, calls back to back
    lse-fold-tests) step lse_fold_tests 420 $PY -m pytest -q -m gpu -p no:cacheprovider -x -rA tests/gpu/test_lse_fold.py ;;
    bwd-phases) step bwd_phases 580 $PY -m measure.bwd_phases --rounds 5 ;;
    bwd-phases-flush) step bwd_phases_flush 580 $PY -m measure.bwd_phases --rounds 5 --flush --name bwd_phases_flush ;;
    det-copies-tests) step det_copies_tests 580 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_bwd_deterministic_copies.py -k "not first_store" ;;
    det-first-store-tests) step det_first_store_tests 580 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_bwd_deterministic_copies.py -k "first_store and not varlen" ;;
    det-first-store-varlen) step det_first_store_varlen 580 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_bwd_deterministic_copies.py -k "first_store and varlen" ;;
    det-db-tests) step det_db_tests 580 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_dq_two_buffers.py ;;  # Note [Two dQ buffers]
    det-db-sanitize) for tool in memcheck racecheck synccheck; do step det_db_$tool 300 $SAN --tool $tool $PY -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu/test_dq_two_buffers.py -k "match_float64 and in_turn-128-True"; done ;;
    det-overlap-tests) step det_overlap_tests 580 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_dq_two_buffers.py -k overlap ;;  # Note [Adds in flight across turns]
    det-overlap-sanitize) for tool in memcheck racecheck synccheck; do step det_overlap_$tool 300 $SAN --tool $tool $PY -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu/test_dq_two_buffers.py -k "match_float64 and overlap-128-True"; done ;;
    det-copies-overlap-tests) step det_copies_overlap_tests 580 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_dq_two_buffers.py -k "copies_with_two_buffers" ;;  # Note [dQ copies]: copies on the overlapped two-buffer kernel
    det-copies-overlap-sanitize) for tool in memcheck racecheck synccheck; do step det_copies_overlap_$tool 300 $SAN --tool $tool $PY -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu/test_dq_two_buffers.py -k "copies_with_two_buffers_match_float64 and 4-True-128-True"; done ;;
    det-copies-overlap-phases) step det_copies_overlap_d64 280 $PY -m measure.bwd_phases --rounds 5 --dims 64 --impls fa4_final fa4_final_deterministic fa4_final_det_c2_overlap fa4_final_det_c4_overlap --name bwd_phases_det_copies_overlap64; step det_copies_overlap_d128 280 $PY -m measure.bwd_phases --rounds 5 --dims 128 --impls fa4_final fa4_final_deterministic fa4_final_det_c2_overlap64 fa4_final_det_c4_overlap64 --name bwd_phases_det_copies_overlap128 ;;  # issue 34: the deterministic price with copies, calls back to back
    det-copies-overlap-phases-flush) step det_copies_overlap_d64_flush 200 $PY -m measure.bwd_phases --rounds 5 --dims 64 --flush --impls fa4_final fa4_final_deterministic fa4_final_det_c2_overlap fa4_final_det_c4_overlap --name bwd_phases_det_copies_overlap64_flush; step det_copies_overlap_d128_flush 200 $PY -m measure.bwd_phases --rounds 5 --dims 128 --flush --impls fa4_final fa4_final_deterministic fa4_final_det_c2_overlap64 fa4_final_det_c4_overlap64 --name bwd_phases_det_copies_overlap128_flush ;;
    det-copies-overlap-sanitize-c2) step det_c2_overlap_memcheck 120 $SAN --tool memcheck $PY -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu/test_dq_two_buffers.py -k "copies_with_two_buffers_match_float64 and 2-True"; step det_c2_overlap_synccheck 120 $SAN --tool synccheck $PY -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu/test_dq_two_buffers.py -k "copies_with_two_buffers_match_float64 and 2-True"; step det_c2_overlap_racecheck 120 $SAN --tool racecheck $PY -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu/test_dq_two_buffers.py -k "copies_with_two_buffers_match_float64 and 2-True-64-False" ;;
    det-copies-default-tests) step det_copies_default_tests 580 env FA4_FINAL_PENDING=det_copies $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_fa4_final_bwd.py tests/gpu/test_fa4_final_varlen_bwd.py tests/gpu/test_fa4_final_api.py tests/gpu/test_lse_fold.py -k "determin" ;;  # Note [Pending features]: the deterministic suites through the call with det_copies let through; once they pass, its row goes
    det-copies-default-bench) step det_copies_default_bench 580 env FA4_FINAL_PENDING=det_copies $PY -m measure.bwd_benchmark --dims 64 128 --rounds 5 --name bwd_bench_det_copies --deadline $(mdl 450) ;;  # issue 34: the benchmark with the deterministic call through the gate, beside the peers
    det-overlap-phases) step det_overlap_phases_d64 400 $PY -m measure.bwd_phases --rounds 5 --dims 64 --impls fa4_final fa4_final_deterministic fa4_final_det_db fa4_final_det_overlap --name bwd_phases_det_overlap64; step det_overlap_phases_d128 400 $PY -m measure.bwd_phases --rounds 5 --dims 128 --impls fa4_final fa4_final_deterministic fa4_final_det_db64 fa4_final_det_overlap64 --name bwd_phases_det_overlap128 ;;  # the deterministic mode with adds in flight across turns against one and two buffers in turn
    rotated-tests) step rotated_tests 580 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_bwd_rotated_walk.py ;;  # Note [A rotated walk]
    rotated-sanitize) for tool in memcheck racecheck synccheck; do step rotated_$tool 300 $SAN --tool $tool $PY -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu/test_bwd_rotated_walk.py -k "matches_float64 and 128-1000-777-False"; done ;;
    rotated-phases) step rotated_phases_d64 300 $PY -m measure.bwd_phases --rounds 5 --dims 64 --impls fa4_final fa4_final_deterministic fa4_final_det_rotated --name bwd_phases_det_rotated64; step rotated_phases_d128 300 $PY -m measure.bwd_phases --rounds 5 --dims 128 --impls fa4_final fa4_final_deterministic fa4_final_det_rotated64 --name bwd_phases_det_rotated128 ;;  # the rotated walk against the deterministic default (causal and S = 16384: the plain walk at the rotated build's registers)
    det-db-phases) step det_db_phases 580 $PY -m measure.bwd_phases --rounds 5 --dims 128 --impls fa4_final fa4_final_deterministic fa4_final_det_64 fa4_final_det_db64 --name bwd_phases_det_db128 ;;
    det-db-phases-d64) step det_db_phases_d64 580 $PY -m measure.bwd_phases --rounds 5 --dims 64 --impls fa4_final fa4_final_deterministic fa4_final_det_db --name bwd_phases_det_db64 ;;
    bwd-racecheck-d128) step bwd_default_racecheck_d128 300 $SAN --tool racecheck $PY -c "from tests.gpu.test_fa4_final_bwd import _check, BF16; [print(_check((2, 1000, 777, 8, 2, 128, BF16), c)[1][:80]) for c in (True, False)]" ;;  # Note [Release after the warp's reads]
    det-racecheck-d128) step det_one_buffer_racecheck_d128_causal 300 $SAN --tool racecheck $PY -c "from tests.gpu.test_fa4_final_bwd import _check, BF16; from tests.gpu.test_dq_two_buffers import two_buffers; print(_check((2, 1000, 777, 8, 2, 128, BF16), True, deterministic=True, config=two_buffers(128, True, buffers=1)))" ;;
    release-all-tests) step release_all_tests 580 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_release_every_thread.py ;;  # Note [Release after the warp's reads]
    release-all-sanitize) for tool in racecheck synccheck memcheck; do step release_all_$tool 300 $SAN --tool $tool $PY -c "from tests.gpu.test_fa4_final_bwd import _check, BF16; from tests.gpu.test_release_every_thread import every_thread; [print(_check((2, 1000, 777, 8, 2, 128, BF16), c, deterministic=det, config=every_thread(128, c, det))[1][:90]) for c, det in ((True, False), (False, False), (True, True))]"; done ;;
    rows-early-phases) step rows_early_phases 580 $PY -m measure.bwd_phases --rounds 5 --dims 128 64 --impls fa4_final fa4_final_rows_early fa4_package --name bwd_phases_rows_early ;;  # lse and delta in registers before the GEMM waits against the default and the FA4 package (issue 34)
    rows-early-d128) step rows_early_d128 400 $PY -m measure.bwd_phases --rounds 5 --dims 128 --impls fa4_final fa4_final_rows_early fa4_package --name bwd_phases_rows_early_d128 ;;  # rows-early-phases at D = 128 only (a short visit)
    rows-early-swapped) step rows_early_swapped 580 $PY -m measure.bwd_phases --rounds 5 --dims 256 192 --impls fa4_final fa4_final_rows_early --name bwd_phases_rows_early_swapped ;;  # the swapped step (D = 192, 256) with lse and delta read before the waits
    rows-shuffled-tests) step rows_shuffled_tests 400 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_fa4_final_bwd.py -k rows_shuffled ;;
    rows-shuffled-phases) step rows_shuffled_phases 400 $PY -m measure.bwd_phases --rounds 7 --dims 64 --impls fa4_final fa4_final_rows_shuffled fa4_package --name bwd_phases_rows_shuffled ;;  # D = 64: lse and delta by shuffles (FA4's way at D <= 64) against the default and the FA4 package
    rows-shuffled-phases-d128) step rows_shuffled_phases_d128 400 $PY -m measure.bwd_phases --rounds 7 --dims 128 --causal yes --impls fa4_final fa4_final_rows_shuffled fa4_package --name bwd_phases_rows_shuffled128 ;;  # rows_shuffled at D = 128, causal (the dense default is an 80-row tile, which it refuses)
    rows-early-tests) step rows_early_tests 400 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_fa4_final_bwd.py -k rows_early ;;
    release-all-phases) step release_all_phases 580 $PY -m measure.bwd_phases --rounds 9 --dims 128 64 --impls fa4_final fa4_final_one_lane fa4_final_deterministic fa4_final_det_one_lane --name bwd_phases_one_lane ;;  # the default (every thread releases) against the one-lane release
    det-sanitize) step det_memcheck 420 $SAN --tool memcheck $PY -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu/test_bwd_deterministic_copies.py -k "match_float64 and 128-False" ;;
    det-phases) step det_phases 580 $PY -m measure.bwd_phases --rounds 5 --dims 128 --impls fa4_final fa4_final_deterministic fa4_final_det_c2 fa4_final_det_early fa4_final_det_c4 fa4_final_det_c4_store fa4_final_det_c2_store --name bwd_phases_det_d128 ;;
    det-phases-d64) step det_phases_d64 580 $PY -m measure.bwd_phases --rounds 5 --dims 64 --impls fa4_final fa4_final_deterministic fa4_final_det_c2 fa4_final_det_early fa4_final_det_c4 fa4_final_det_c4_store fa4_final_det_c2_store --name bwd_phases_det_d64 ;;
    api-tests) step api_tests 900 $PY -m pytest -q -m gpu -p no:cacheprovider -x -rA tests/gpu/test_fa4_final_api.py tests/gpu/test_fa4_final_training.py ;;
    api-varlen-tests) step api_varlen_tests 540 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_fa4_final_api.py tests/gpu/test_fa4_final_varlen_bwd.py ;;
    varlen-tests) step varlen_tests 480 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_fa4_final_api.py tests/gpu/test_fa4_final_varlen_bwd.py -k varlen ;;
    varlen-bench) step varlen_bench 420 $PY -m measure.package_varlen ;;
    varlen-sanitize) step varlen_memcheck 300 $SAN --tool memcheck $PY -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu/test_fa4_final_api.py -k "test_varlen_forward and b70" ;;
    varlen-bwd-sanitize) step varlen_bwd_memcheck 300 $SAN --tool memcheck $PY -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu/test_fa4_final_varlen_bwd.py -k "against_float64 and (mixed-causal-used or many)" ;;
    fa4-bench) step fa4_bench 480 $PY -m measure.benchmark --versions fa4_final flash_hopper --name fa4_final_fwd --seqlens 4096 16384 --dims 64 128 --causal both --rounds ${ROUNDS:-3} ;;
    decode) step decode 580 $PY -m measure.decode --dims 128 --deadline 500 ;;
    decode-b32) step decode_b32 580 $PY -m measure.decode --dims 128 --batch 32 --tokens 1 4 16 --keys 1024 8192 32768 131072 --heads 32/8 64/8 --deadline $(mdl 500) ;;  # results/<gpu>/decode.json as the H100 row of PRODUCES measures it: batch 32, every token and key count
    decode-grid-32) step decode_grid_32 580 $PY -m measure.decode --name decode --dims 128 --heads 32/8 --no-keys-on-m --rows $DECODE_ROWS --deadline $(mdl 500) ;;  # issue 32's grid, one heads pair a step
    decode-grid-64) step decode_grid_64 580 $PY -m measure.decode --name decode_h64 --dims 128 --heads 64/8 --no-keys-on-m --rows $DECODE_ROWS --deadline $(mdl 500) ;;
    decode-grid-d64-32) step decode_grid_d64_32 580 $PY -m measure.decode --name decode_d64 --dims 64 --heads 32/8 --no-keys-on-m --rows $DECODE_ROWS --deadline $(mdl 500) ;;
    decode-grid-d64-64) step decode_grid_d64_64 580 $PY -m measure.decode --name decode_d64_h64 --dims 64 --heads 64/8 --no-keys-on-m --rows $DECODE_ROWS --deadline $(mdl 500) ;;
    decode-graph) step decode_graph 580 $PY -m measure.decode --name decode_graph --dims 128 --batch 1 32 --tokens 1 16 --keys 1024 8192 131072 --heads 32/8 --modes graph back_to_back --no-keys-on-m --rows $DECODE_ROWS --deadline $(mdl 500) ;;  # issue 32: the calls replayed from CUDA graphs beside the same calls back to back (batch 1 waits for the host)
    decode-pdl) step decode_pdl 580 $PY -m measure.decode --name decode_pdl --dims 128 --batch 1 32 --tokens 1 16 --keys 1024 8192 131072 --heads 32/8 --modes graph back_to_back --variants pdl --no-keys-on-m --rows $DECODE_ROWS fa4_final_decode_pdl --deadline $(mdl 500) ;;  # Note [The combine launches early]: the default against its combine launched early
    decode-short-keys) step decode_short_keys 250 $PY -m measure.decode --name decode_short_keys --dims 128 --batch 1 --tokens 1 16 --keys 1024 2048 --heads 32/8 --modes graph --variants split2 n64s3 n64s4 --no-keys-on-m --rows fa4_final_decode fa4_final_decode_split2 fa4_final_decode_n64s3 fa4_final_decode_n64s4 sdpa_cudnn sdpa_flash fa4_package --deadline $(mdl 200) ;;  # issue 32: batch 1 with few keys, where the split kernel trails cuDNN's: twice the splits, 64-key tiles
    decode-b128-splits) step decode_b128_splits 300 $PY -m measure.decode --name decode_b128_splits --dims 128 --batch 128 --tokens 1 16 --keys 8192 --heads 32/8 --modes back_to_back --variants split2 split3 split5 n64s3b32 --no-keys-on-m --rows fa4_final_decode fa4_final_decode_split2 fa4_final_decode_split3 fa4_final_decode_split5 fa4_final_decode_n64s3b32 fa4_package sdpa_cudnn --deadline $(mdl 250) ;;  # issue 32: batch 128, where the call trails the FA4 package: more splits against the last wave's idle SMs
    decode-timeline) step decode_timeline 300 $PY -m measure.decode_timeline ;;  # issue 32: batch-1 steps replayed from graphs, kernel by kernel (ours: split + combine; cuDNN)
    decode-combine) step decode_combine_tests 300 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_decode_combine.py -k candidates; step decode_combine 400 $PY -m measure.decode --name decode_combine --dims 128 --batch 1 --tokens 1 16 --keys 1024 8192 131072 --heads 32/8 --modes graph back_to_back --variants c4 c8 c16 c4p c16p --no-keys-on-m --rows fa4_final_splits fa4_final_decode fa4_final_decode_c4 fa4_final_decode_c8 fa4_final_decode_c16 fa4_final_decode_c4p fa4_final_decode_c16p sdpa_cudnn sdpa_flash fa4_package --deadline $(mdl 280); step decode_timeline_combine 150 $PY -m measure.decode_timeline --name decode_timeline_combine --impls fa4_final_decode fa4_final_decode_c4 fa4_final_decode_c8 fa4_final_decode_c16 fa4_final_decode_c16p sdpa_cudnn ;;  # Note [Which combine a call runs]: the combine candidates' bits, their batch-1 steps replayed beside the default and the peers, then kernel by kernel
    decode-combine-short) step decode_combine_tests 200 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_decode_combine.py -k candidates; step decode_combine 300 $PY -m measure.decode --name decode_combine --dims 128 --batch 1 --tokens 1 16 --keys 1024 8192 --heads 32/8 --modes graph --variants c4 c4p c16p --no-keys-on-m --rows fa4_final_decode fa4_final_decode_c4 fa4_final_decode_c4p fa4_final_decode_c16p sdpa_cudnn --deadline $(mdl 150); step decode_timeline_combine 120 $PY -m measure.decode_timeline --name decode_timeline_combine --impls fa4_final_decode fa4_final_decode_c4 fa4_final_decode_c16p sdpa_cudnn ;;  # decode-combine cut for a short visit: graph mode, 1k and 8k keys, the call, the plain combine (c4), c4p, c16p and cuDNN
    decode-host) step decode_host 200 $PY -m measure.decode_host --gpu ;;  # issue 32: a batch-1 decode call's host time beside its GPU time, API and kernel launched directly, and where the host time goes
    decode-b128-variants) step decode_b128_variants 580 $PY -m measure.decode --name decode_b128_variants --dims 128 --batch 128 --tokens 1 16 --keys 8192 131072 --heads 32/8 --variants n128s2 n128s2b32 n64s3b32 --no-keys-on-m --rows fa4_final_splits fa4_final_decode fa4_final_decode_n128s2 fa4_final_decode_n128s2b32 fa4_final_decode_n64s3b32 fa4_package fa4_package_splits sdpa_cudnn --deadline $(mdl 500) ;;  # issue 32: where batch 128 trails the FA4 package by ~3%, the stage and CTA-count candidates
    decode-profile) step decode_profile 580 $PY -m measure.profile_decode --raw-dir "$OUT/decode_profile_raw" ;;  # ncu: ours and cuDNN at the memory-bound shapes where ours trails
    bwd-versus-profile) step bwd_versus_profile 580 $PY -m measure.profile_bwd_versus --raw-dir "$OUT/bwd_versus_profile_raw" ;;  # ncu: our backward main kernel and the FA4 package's, D = 128 (issue 34)
    decode-d64) step decode_d64 580 $PY -m measure.decode --name decode_d64 --dims 64 --deadline 500 ;;
    headdim-tests) step headdim_tests 580 $PY -m pytest -q -m gpu -p no:cacheprovider -x -rA tests/gpu/test_fwd_head_dims.py -k "not pairwise" ;;
    headdim-tests2) step headdim_tests2 580 $PY -m pytest -q -m gpu -p no:cacheprovider -x -rA tests/gpu/test_fwd_head_dims.py -k pairwise ;;
    bwd-headdim-tests) step bwd_headdim_tests 580 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_bwd_head_dims.py -k "not d192 and not d256" ;;
    bwd-headdim-tests-d192) step bwd_headdim_tests_d192 580 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_bwd_head_dims.py -k "d192 and not d192v192" ;;
    bwd-headdim-tests-d192v192) step bwd_headdim_tests_d192v192 580 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_bwd_head_dims.py -k d192v192 ;;
    bwd-headdim-tests-d256) step bwd_headdim_tests_d256 580 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_bwd_head_dims.py -k d256 ;;
    features-bwd) step features_bwd 580 $PY -m measure.features --name features_bwd --cases bwd_d96 bwd_d192 --deadline 500 ;;
    bwd-swapped-sanitize) for tool in memcheck racecheck synccheck; do step bwd_swapped_$tool 420 $SAN --tool $tool $PY -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu/test_bwd_head_dims.py -k "test_backward_matches_float64 and 2-77-77 and (d192v192 or d256)"; done ;;
    softcap-headdim-tests) step softcap_headdim_tests 580 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_softcap_head_dims.py ;;
    bwd-headdim-racecheck) for t in d96 d192 d192v192 d256; do k="test_backward_matches_float64 and 2-77-77 and $t"; [ $t = d192 ] && k="$k and not d192v192"; step bwd_racecheck_$t 420 env CUTE_DSL_LINEINFO=1 $SAN --tool racecheck $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_bwd_head_dims.py -k "$k"; done ;;
    bwd-headdim-synccheck) step bwd_headdim_synccheck 580 $SAN --tool synccheck $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_bwd_head_dims.py -k "test_backward_matches_float64 and 2-77-77" ;;  # all four builds (d96, d192, d192v192, d256), no -x: Note [Barriers of two builds]
    features-bwd-swapped) step features_bwd_swapped 580 $PY -m measure.features --name features_bwd_swapped --cases bwd_d192v192 bwd_d256 --deadline 500 ;;
    seqused-q-tests) step seqused_q_tests 700 $PY -m pytest -q -m gpu -p no:cacheprovider -x -rA tests/gpu/test_seqused_q.py ;;
    headdim-sanitize) step headdim_memcheck 300 $SAN --tool memcheck $PY -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu/test_fwd_head_dims.py -k "b1-17x17 or b2-300x77" ;;
    features) step features 580 $PY -m measure.features --deadline $(mdl 500) ;;
    softcap-tests) step softcap_tests 580 $PY -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu/test_softcap_sinks.py -k "not backward" ;;
    softcap-tests2) step softcap_tests2 580 $PY -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu/test_softcap_sinks.py -k backward ;;
    softcap-api-tests) step softcap_api_tests 900 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_softcap_sinks_api.py ;;
    pending-api-tests) step pending_api_tests 580 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_pending_api.py -k lse_fold ;;
    pending-api-tests2) step pending_api_tests2 580 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_pending_api.py -k head_dims ;;
    pending-api-tests3) step pending_api_tests3 580 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_pending_api.py -k seqused_q ;;
    sdpa-tests) step sdpa_tests 900 $PY -m pytest -q -m gpu -p no:cacheprovider -x -rA tests/gpu/test_sdpa_registration.py ;;
    decode-tests) step decode_tests 580 $PY -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/gpu/test_decode_combine.py tests/gpu/test_decode_kernel.py tests/gpu/test_ch15_decoding.py -k "not keys_on_m and not two_consumers and not cluster" ;;
    decode-keys-on-m-tests) step decode_keys_on_m_tests 580 $PY -m pytest -q -m gpu -p no:cacheprovider --tb=short -rA tests/gpu/test_decode_kernel.py -k keys_on_m ;;
    decode-two-consumers-tests) step decode_two_consumers_tests 580 $PY -m pytest -q -m gpu -p no:cacheprovider --tb=short -rA -s tests/gpu/test_decode_kernel.py -k two_consumers ;;
    decode-two-consumers-bench) step decode_wg2 580 $PY -m measure.decode --name decode_wg2 --dims 128 64 --batch 1 32 --tokens 16 --keys 8192 32768 131072 --heads 64/8 128/8 --variants wg2 --no-keys-on-m --deadline 500 ;;
    decode-two-consumers-sanitize) for tool in synccheck racecheck memcheck; do step decode_two_consumers_$tool 420 $SAN --tool $tool $PY -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu/test_decode_kernel.py -k "two_consumers_paged and 16-2-128"; done ;;
    decode-cluster-tests) step decode_cluster_tests 580 $PY -m pytest -q -m gpu -p no:cacheprovider --tb=short -rA -s tests/gpu/test_decode_kernel.py -k cluster ;;  # Note [A pair of CTAs shares the cache]: 23 passed on an H100 (results/h100/gpu_checks.json)
    decode-cluster-sanitize) for tool in synccheck racecheck memcheck; do step decode_cluster_$tool 420 env CUTE_DSL_LINEINFO=1 $SAN --tool $tool $PY -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu/test_decode_kernel.py -k "cluster_paged and 128-1-128"; done ;;
    decode-cluster-bench) step decode_pair 580 $PY -m measure.decode --name decode_pair --dims 128 64 --batch 32 1 --tokens 16 --keys 8192 32768 131072 --heads 128/8 64/8 --variants pair --no-keys-on-m --deadline 500 ;;
    decode-bad-values-memcheck) step decode_bad_values_memcheck 420 $SAN --tool memcheck $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_decode_api.py -k "bad_values_after_the_launch and default" ;;  # Note [Paged KV checks]: a bad launch reads nothing out of bounds
    decode-sanitize) step decode_memcheck 420 $SAN --tool memcheck $PY -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu/test_decode_kernel.py -k "gathered or paged_equals_contiguous_bit_for_bit" ;;
    decode-racecheck) step decode_racecheck 420 $SAN --tool racecheck $PY -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu/test_decode_kernel.py -k "gathered and 16-1-128" ;;
    decode-synccheck) step decode_synccheck 420 $SAN --tool synccheck $PY -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu/test_decode_kernel.py -k "gathered and 16-1-128" ;;
    decode-variants) step decode_variants 580 $PY -m measure.decode --name decode_variants --dims 128 --batch 1 32 --tokens 1 4 --keys 8192 131072 --heads 32/8 --variants n64s3 n64s4 n128s2 split2 --no-keys-on-m --deadline $(mdl 500) ;;
    decode-boxes) step decode_boxes 580 $PY -m measure.decode --name decode_boxes --dims 128 --batch 32 1 --tokens 1 16 --keys 8192 131072 --heads 32/8 --variants b32 b16 n128s2 --no-keys-on-m --rows fa4_final_splits fa4_final_decode fa4_final_decode_b32 fa4_final_decode_b16 fa4_final_decode_n128s2 fa4_package fa4_package_splits sdpa_cudnn --deadline $(mdl 500) ;;  # Note [Boxes of a contiguous cache]: a tile from boxes of 32 or 16 keys beside one box, and two stages
    decode-boxes-b32) step decode_boxes_b32 400 $PY -m measure.decode --name decode_boxes_b32 --dims 128 --batch 32 --tokens 1 --keys 8192 131072 --heads 32/8 --variants b32 b16 n128s2 --no-keys-on-m --rows fa4_final_splits fa4_final_decode fa4_final_decode_b32 fa4_final_decode_b16 fa4_final_decode_n128s2 fa4_package sdpa_cudnn --deadline $(mdl 300) ;;  # decode-boxes at batch 32, one token only (a short visit)
    decode-boxes-more) step decode_boxes_wg2 290 $PY -m measure.decode --name decode_boxes_wg2 --dims 128 --batch 32 1 --tokens 16 --keys 8192 131072 --heads 64/8 --variants wg2b32 --no-keys-on-m --rows fa4_final_splits fa4_final_decode fa4_final_decode_wg2b32 fa4_package fa4_package_splits sdpa_cudnn --deadline $(mdl 240); step decode_boxes_d64 290 $PY -m measure.decode --name decode_boxes_d64 --dims 64 --batch 32 1 --tokens 1 16 --keys 8192 131072 --heads 32/8 --variants b32 --no-keys-on-m --rows fa4_final_splits fa4_final_decode fa4_final_decode_b32 fa4_package fa4_package_splits sdpa_cudnn --deadline $(mdl 240) ;;  # boxes with two consumers (128 packed rows) and at D = 64
    decode-boxes-tests) step decode_boxes_tests 300 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_decode_kernel.py -k contiguous_cache_read_in_boxes ;;
    decode-paged16) step decode_paged16 580 $PY -m measure.decode --name decode_paged16 --dims 128 --page 16 --deadline 500 ;;
    decode-repeated-tests) step decode_repeated_tests 400 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_decode_api.py -k "repeated or num_splits_1_0_3 or cuda_graph" ;;  # Note [A repeated decode call]: its GPU tests and the tests whose fixture turns it off
    decode-api-tests) step decode_api_tests 580 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_decode_api.py ;;
    headdim-varlen) step headdim_varlen 300 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_fwd_head_dims.py -k "varlen" ;;
    fa4-gaps) step fa4_gaps 300 $PY -m measure.fwd_knobs --knobs --gaps --only "O rescaled" "mask as bit" ;;
    fa4-split) step fa4_split 420 $PY -m measure.fwd_knobs --knobs --non-causal --only "last round" "cut along" --rounds ${ROUNDS:-5} --name fa4_final_split ;;
    fa4-d64c) step fa4_d64c 420 $PY -m measure.fwd_knobs --knobs --shape 64 16384 1 --only "one tile per CTA, L2" "stages 2/2" "zigzag rounds in L2" "128 x 128" "after the softmax" --rounds ${ROUNDS:-7} --name fa4_final_d64_causal ;;
    fa4-d64) step fa4_d64 540 $PY -m measure.fwd_knobs --knobs --shape 64 4096 0 --shape 64 4096 1 --shape 64 16384 0 --shape 64 16384 1 --only "exp2 emulation" "tau = 8" --rounds ${ROUNDS:-5} --name fa4_final_d64_softmax ;;
    fa4-tune) step fa4_tune 560 $PY -m measure.fwd_knobs --knobs --all-shapes --only "tau = 8" --exact --settle-ms 50 --rounds ${ROUNDS:-5} --name fa4_final_tune ;;
    fa4-bench-settled) step fa4_bench_settled 480 $PY -m measure.benchmark --versions fa4_final flash_hopper --name fa4_final_fwd_settled --seqlens 4096 16384 --dims 64 128 --causal both --rounds ${ROUNDS:-5} --settle-ms 50 ;;
    clocked) step fa4_clocked 560 $PY -m measure.fwd_clocked ${CLOCKED_ARGS:-} ;;
    clocked-d64c2) step fa4_clocked_d64c2 560 $PY -m measure.fwd_clocked --shape 64 16384 1 --shape 64 4096 1 --variants fa4_final "K/V stages 2/2" "K/V stages 2/2, tau = 8" "K/V stages 2/2, O rescaled after the softmax" "K/V stages 2/2, tau = 8, O rescaled after the softmax" fa4_package --name fa4_final_clocked_d64_causal_stages ;;
    clocked-d64c) step fa4_clocked_d64c 560 $PY -m measure.fwd_clocked --shape 64 16384 1 --shape 64 4096 1 --variants fa4_final "tau = 8" "O rescaled after the softmax" "tau = 8, O rescaled after the softmax" "one tile per CTA, L2 sections" "zigzag rounds in L2 sections" "K/V stages 2/2" fa4_package --name fa4_final_clocked_d64_causal ;;
    clocked-rowmax) step fa4_clocked_rowmax 560 $PY -m measure.fwd_clocked --shape 64 16384 1 --shape 64 4096 1 --variants fa4_final "row sum in one chain" "row sum in one chain, row max in four chains" "row max in four chains" fa4_package --name fa4_final_clocked_row_max ;;
    clocked-lane) step fa4_clocked_lane 560 $PY -m measure.fwd_clocked --variants fa4_final "lane read every step" fa4_package --name fa4_final_clocked_lane ;;
    clocked-skip) step fa4_clocked_skip 560 $PY -m measure.fwd_clocked --variants fa4_final "tau = 8, rows decide alone" "tau = 0, O multiply skipped when no max moved" "tau = 8" fa4_package --name fa4_final_clocked_skip ;;
    skip-check) step skip_check 300 $PY -m measure.fwd_checks --knob rescale_skip_unchanged ;;
    predecessors) step fa4_predecessors 300 $PY -m measure.fwd_predecessors ;;
    energy) step fa4_energy 300 $PY -m measure.fwd_energy ;;
    fa4-check-defaults) step fa4_check_defaults 300 $PY -m measure.fwd_checks --defaults --save ;;
    split-check) step split_check 300 $PY -m measure.fwd_checks --knob split_tail ;;
    dyn-check) step dyn_check 240 $PY -m measure.fwd_checks --knob dynamic ;;
    dyn-sanitize)
      for tool in memcheck racecheck synccheck; do
        step "san_dyn_${tool}" 240 $SAN --tool $tool $PY -m measure.fwd_checks --small --knob dynamic
      done ;;
    clocked-dyn) step fa4_clocked_dyn 560 $PY -m measure.fwd_clocked --shape 64 16384 1 --shape 64 4096 1 --shape 128 16384 1 --shape 128 4096 1 --variants fa4_final "tile table" fa4_package --name fa4_final_clocked_dynamic ;;
    varlen-dyn-sanitize)  # the varlen forward's dynamic tiles: idle CTAs, many sequences, D = 64
      for tool in memcheck racecheck synccheck; do
        step "san_varlen_${tool}" 300 $SAN --tool $tool $PY -m pytest -q -m gpu -p no:cacheprovider -x tests/gpu/test_fa4_final_api.py -k "idle_ctas or (test_varlen_forward and (b70 or d64-float16-causal1))"
      done ;;
    split-sanitize)
      for tool in memcheck racecheck synccheck; do
        step "san_split_${tool}" 300 $SAN --tool $tool $PY -m measure.fwd_checks --small --split
      done ;;
    fa4-sched) step fa4_sched 420 $PY -m measure.fwd_knobs --knobs --all-shapes --only "one tile per CTA" "zigzag" --name fa4_final_sched ;;
    ch12-sweep) step package_sweep 420 $PY -m measure.package_sweep --sweep ;;
    host) step package_host 420 $PY -m measure.package_host --gpu ;;
    host-train) step package_training 300 $PY -m measure.package_training ;;
    ch12-acc) step package_acc 200 $PY -m measure.package_sweep --accuracy --memory ;;
    fa4-knobs) step fa4_knobs 480 $PY -m measure.fwd_knobs --knobs --rounds ${ROUNDS:-3} ;;
    fa4-ablation) step fa4_ablation 420 $PY -m measure.fwd_knobs --ablation ;;
    fa4-timeline) step fa4_timeline 120 $PY -m measure.fwd_timeline ;;
    micro) step microbench 300 $PY -m measure.microbench ;;
    ring) step ring 420 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_ring_attention.py ;;  # chapter 14: 2 ranks on one GPU (gloo), NCCL with 2+ GPUs, the merge kernels
    ring-scaling) step ring_scaling 600 $PY -m measure.ring_scaling ;;  # chapter 14, 2-8 GPUs only: refuses on one
    ch03) step ch03_kernels 300 $PY -m measure.ch03_kernels ;;
    sanitize)
      for m in ${SANITIZE:-ch04_flash_ampere ch05_flash_hopper}; do
        for tool in memcheck racecheck synccheck; do
          step "san_${m}_${tool}" 300 $SAN --tool $tool $PY -m solutions.$m --small
        done
      done ;;
    probes) step probes 420 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_protocol_probes.py ;;
    conformance) step conformance 580 $PY -m measure.conformance --cases ${CASES:-240} --workers ${WORKERS:-6} --deadline ${CONF_DEADLINE:-520} ;;
    conformance-features) step conformance_features 580 $PY -m measure.conformance --cases ${CASES:-72} --workers ${WORKERS:-6} --deadline ${CONF_DEADLINE:-520} --features softcap,learnable_sink --name conformance_fa4_features ;;
    conformance-sample) step conformance_sample 300 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_conformance_fa4.py ;;
    window-tests) step window_tests 580 $PY -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_fa4_final_api.py tests/gpu/test_fa4_final_bwd.py -k "test_flash_attn_func_forward or test_varlen_forward or test_backward or test_varlen_backward_matches or test_sliding_windows or test_deterministic_is_bitwise" ;;
    notebooks) step notebooks 580 env COURSE_STRICT_EXERCISES=1 $PY -m pytest -q -p no:cacheprovider --nbval-lax --nbval-cell-timeout=600 ${NOTEBOOKS:-solutions/} ;;
    record)  # the test and sanitizer logs of this visit -> results/h200/gpu_checks.json
      args=()
      for log in "$OUT"/logs/*.log; do
        n=$(basename "$log" .log)
        case $n in gpu_tests|bwd_tests|api_tests|probes|window_tests|conformance_sample|api_varlen_tests|varlen_tests|varlen_memcheck|varlen_bwd_memcheck|san_*|*_check|*_tests|headdim_memcheck) args+=("$n=$log") ;; esac
      done
      [ ${#args[@]} -gt 0 ] && step record 60 $PY -m measure.gpu_checks "${args[@]}" ;;
    *) echo "unknown step $s"; status=1 ;;
  esac
done
tar cf "$OUT/results.tar" results 2>/dev/null
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
exit $status
