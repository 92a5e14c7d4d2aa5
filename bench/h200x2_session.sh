#!/usr/bin/env bash
# One GPU session on the two-GPU H200 machine (nvidia-h200-x2): every GPU measurement the issues
# ask for, run as two background job queues (one per GPU) that outlive the 10-minute call limit,
# then a DP=2 stage on both GPUs. Results: /root/session/<job>/ (logs, JSON), collected into
# $OUT/session.tgz by `wait`.
#
#   run 1..3: stage vLLM onto the GPU machine (its staging instructions; the last call then:)
#             bash bench/h200x2_session.sh launch && bash bench/h200x2_session.sh wait 480
#             (that call's own time limit must exceed staging + ~30 s of checkpoint building + the wait:
#             a call cut before `wait` packs the results returns nothing)
#   run 4..:  bash bench/h200x2_session.sh wait 560     (until it prints "all done")
#
# GPU 0: tiny vLLM-vs-reference parity (240 requests) -> 9B-shaped BF16 clef-bench server vs raw
#        vLLM -> tiny clef-bench DP=1 (+ clef-parity vs the reference) -> engine-kill faults
# GPU 1: quality on the trained proxy incl. the vLLM-served column -> 9B-shaped FP8 server vs raw
# both: tiny server DP=2 correctness (vllm_parity --dp 2) -> tiny clef-bench DP=2 server vs raw DP=2
# PLAN=bench (issue 5 follow-up) instead: GPU 0: 9B BF16 DP=1; GPU 1: 9B FP8 DP=1, tiny DP=1;
# both: 9B BF16 DP=2 server vs raw DP=2, tiny DP=2 (clef-bench only, no quality/parity/faults).
# PLAN=reuse (issues 12-14): GPU 0: 9B BF16 server (prefill graphs, cache off) vs raw -> 9B BF16 with
#        --state-cache on (shared-state + the unique-state workloads); GPU 1: tiny parity (240) -> graphs
#        and offline-API checks (fast_paths) -> 9B BF16 shared-state with the cache off; both: 9B BF16
#        DP=2 with the cache on (shared-state, one-state and 32-state variants: the affinity hits).
# PLAN=sixth ran once, at commit a8b158d (its commands: bench/results/h200x2_session_2026-12-01.log); its
#        layer-scope jobs cannot run since that scope was removed, so the plan is no longer here.
# PLAN=sixthb (after the sixth session's first run): GPU 0: latency.py graphs vs cache (in-process follow-ups
#        on a cached 16k state, profiled); GPU 1: a context-filling 16,384-token request chunked by
#        --max-num-batched-tokens 4096 (the scheduler's rule 0 on the GPU); both: DP=2 with the cache on
#        again (the worker now beside the scheduler), then DP=2 short server vs raw (the executor change).
# PLAN=eighth (two GPUs; not run yet): the state cache with hits at the state's end (--state-cache-match
#        unit, the default): GPU 0: 9B BF16 cache-on sweep -> latency.py graphs vs cache; GPU 1: tiny
#        GPU cases (full / partial hit, concurrent, eviction) -> clef-parity cache on vs the reference ->
#        the cache-off unique-state comparison -> 9B BF16 shared-state with --state-cache-match block ->
#        9B FP8 cache-on shared-state; both: DP=2 with the cache on.
# PLAN=eighth1: the same on the one-GPU machine (nvidia-h200), one queue, no DP=2: tiny GPU cases -> 9B BF16
#        cache-on sweep -> cache-off unique-state comparison -> whole-block A/B -> parity receipt -> latency.py.
# PLAN=ninth1 (one GPU): why a burst of 64 hits on one 4k state ran at half the rate of 16 at a time:
#        latency.py bursts of 1/16/64 follow-ups in process (unit vs block matching, profiled), then the 9B
#        server's shared-state and short sweeps with the Server-Timing stages recorded per point.
# PLAN=tenth1 ran twice in the seventh session without a result (commands: bench/results/h200_session_2026-12-01e.log);
#        PLAN=eleventh1 replaced it.
# PLAN=eleventh1 (one GPU): the timeline again, now split at AsyncLLM's hand-offs (sent / received), on the server
#        as it runs (prefill graphs, warm-up, cache on; the server log is checked for JIT compiles after ready),
#        short and shared-state follow-ups at c=1; then the default server's short sweep vs raw vLLM (both now send
#        vLLM's rendered token input: no thread-pool hop); then latency.py graphs in process (GPU kernel table).
# PLAN=twelfth1 (one GPU): a Clef request's state keys as vLLM's block hashes (no re-hashing in the engine core)
#        and the front-end's key memo: the tiny GPU state-cache cases (hits must stay bit-identical) -> the 9B
#        shared-state sweep (c=1/16/64) and short c=1 with the trace on -> latency.py graphs (GPU idle
#        timeline) -> the tiny cache-on parity receipt.
# PLAN=thirteenth1 (one GPU): follow-ups at c=1 on the 9B BF16 server with the key hashes (trace on; the 16k
#        target), latency.py graphs in process for BF16 and online FP8 (the GPU idle timeline per request),
#        then one short FP8 decision at c=1 through the server vs raw vLLM FP8.
# PLAN=fourteenth1 (one GPU): latency.py graphs for BF16 and FP8 with the worker's phases marked
#        (gpu_phases: where inside a step the GPU idles: GDN cores, joint head, the rest).
# PLAN=fifteenth1 (one GPU): the head graphs: their GPU check (tests/gpu/head_graphs.py), latency.py graphs vs
#        eagerhead (BF16, phases) and graphs FP8, the short sweep server vs raw, and the tiny parity.
#        Its head-graph captures failed (a host-to-device copy inside the head); sixteenth1 re-runs it after the fix
#        (parity_tiny last, if time allows: left out).
# PLAN=sixteenth1 (one GPU): fifteenth1's head-graph jobs again, FP8 last.
# PLAN=seventeenth1 (one GPU; tenth session, round 1): the head graphs A/B through the server on one machine (short sweep
#        with raw, then the same server with --head-graphs off), their GPU check, latency.py graphs vs eagerhead,
#        the tiny parity with the head graphs on, and FP8 short c=1 server vs raw (the 20 ms target through HTTP).
# PLAN=eighteenth1 (one GPU; tenth session, round 2): with the head graphs, the state cache's follow-ups at c=1 (4k and 16k states, plus
#        short, --state-cache on) in BF16 and FP8, FP8 short c=1 with the cache off, and the tiny server's
#        short req/s at c=16/64.
# PLAN=nineteenth1 (one GPU; not run yet): head graphs for steps finishing several requests (their GPU check, the
#        state cache's tiny GPU cases since unkeyed requests are no longer hashed, then
#        short c=1/16/64 with --head-graph-records 16 next to the default server and raw vLLM, the tiny
#        parity with it, and the tiny server's short req/s with it); then why online FP8 is faster than BF16 in process but slower through the
#        server and raw AsyncLLM: latency.py FP8 (ours and raw) with the engine core in process, then in its own
#        process as the server runs it, and BF16 in its own process.
# PLAN=twentieth1 (one GPU): the head graphs' new defaults (steps finishing up to 16 requests; every record bucket
#        checked during the warm-up): the tiny server's short c=16/64, then 9B BF16 short c=1/16/64 vs raw vLLM.
# PLAN=twentyfirst1 (one GPU; twelfth session, round 1): FP8 and BF16 short c=1 traced with the cache on (where FP8
#        loses its in-process lead through the server; the 4k/16k follow-ups beside it), head graphs for up to 64
#        requests a step (the head alone, 9B short c=16/64 with 64 and with the default 16), short+long c=1 with the
#        cache on and off (the unique-state cost).
# PLAN=twentysecond1 (one GPU; twelfth session, round 2): unique-state traffic, all workloads: the default server vs raw
#        vLLM, then --state-cache on, then the default server again.
# PLAN=twentythird1 (one GPU; not run yet: its one call was cut before `wait` packed anything): unique short requests traced (graph counters per request) with
#        the cache on (short first, then shared-state) and off; then the FP8 and BF16 servers' engine cores
#        torch-profiled over five short decisions at c=1 (CLEF_VLLM_PROFILE).
# PLAN=twentyfourth1 (one GPU): whether the CPU sets one short decision's latency (25.9-40 ms p50 across server starts
#        with identical graph replays): bench/host_speed.py times Python and CUDA launches on every CPU, then
#        bench/placement.sh starts the 9B BF16 server three times and runs short c=1 as started, pinned to the eight
#        fastest CPUs, to the eight slowest, and unpinned again.
# PLAN=twentyfifth1 (one GPU): paired A/B (bench/paired.sh: three 9B servers side by side, clef-bench --versus):
#        BF16 cache off vs on (short, long-4k) and BF16 vs online FP8 (short), at c=1.
# PLAN=twentysixth1 (one GPU; not run yet; ~500 s): correctness first. bench/step_graph_probe.py (which inputs of a
#        single-sequence step keep their addresses; the whole backbone in one graph, static and direct, against the
#        normal path, timed), then the tiny checkpoint's graphs against vLLM's path with --prefill-graph-scope layer
#        and with step (fast_paths --scope).
# PLAN=twentyseventh1 (one GPU; not run yet; ~1,000 s; after twentysixth1 passed): paired (bench/paired.sh, 9B servers
#        side by side): BF16 core vs step (short and long-4k at c=1, short at c=16/64 in time blocks) and FP8 core vs
#        step (short), four servers; then BF16 core vs layer (short, long-4k), two servers.
# PLAN=twentyeighth1 (one GPU; ~1,050 s): after the fix of the step graphs' GDN metadata (captured for the padded
#        size): the probe and fast_paths --scope step again, then paired core vs step (BF16 short/long-4k c=1, short
#        c=16/64) and FP8 core vs step (short c=1).
# PLAN=twentyninth1 (one GPU; ~1,600 s): what the step scope needs before it becomes the default: the 240-request
#        parity against the reference with --prefill-graph-scope step, the state-cache cases on it, paired core vs
#        step again (short c=1 with its per-pair JSON, c=16), follow-ups on cached 4k/16k states with and without
#        the step scope (both --state-cache on), a torch profile of a step server's engine core (short c=1),
#        bench/latency.py --modes graphs,step (in process, profiler-backed), and the probe's new "fresh" flavour.
# PLAN=thirtieth1 (one GPU; ~560 s): twentyninth1's two failures again after the fix of padded rows in step graphs
#        (non-finite garbage in them reached the GDN state): the step-scope parity, paired follow-ups with the state cache.
# PLAN=thirtyfirst1 (one GPU; ~1,750 s): the defaults' parity (step scope, shared GDN metadata), the default server
#        vs raw vLLM (short BF16 c=1/16/64, FP8 c=1), paired follow-ups on cached states (core vs step, both cache on,
#        each side pool its own size), a profiled default server (step timeline), fast_paths on the step scope, and
#        the cache's cost on unique short requests (off vs on).
# PLAN=thirtysecond1 (one GPU; ~300 s): where steps of several short decisions spend their time (c=16 and c=64 short,
#        the default server's engine core profiled, bench/step_timeline.py), for the c=16/64 gap to raw vLLM.
# PLAN=thirtythird1 (one GPU; ~1,650 s): the c=16 profile again (its window now fits), raw vLLM's at c=16 (requests
#        per step), online FP8's step at c=1
#        profiled, the default server vs raw at c=16/64 with 512 requests a point, and FP8 follow-ups on a cached 16k
#        state with the step scope, paired with BF16.
# PLAN=thirtyfourth1 (one GPU; ~1,150 s): vLLM's async scheduling (--async-scheduling on) for issue 12's c=16/64
#        target: paired against the default (short c=1, c=16/64), the async server vs raw vLLM at c=16/64 with 512
#        requests a point, the 240-request parity with async scheduling, and the c=16 profiles of the async server
#        and of raw vLLM (requests and GPU idle per step).
# PLAN=thirtyfifth1 (one GPU; ~1,550 s): the backbone's GEMM time per padded token count (BF16, online FP8's
#        cutlass kernel; bench/gemm_sizes.py: where buckets are cheap), then --eager-batches on (steps of several
#        sequences above 2,048 tokens that a capture size would pad by more than an eighth run at their own size):
#        paired against the default at c=16/64, and next to raw vLLM at c=16/64 with 512 requests a point; then
#        buckets every 32 tokens from 256 to 512 (--prefill-graph-buckets: a ~400-token decision padded to 416, not
#        448) paired against the default at c=1, BF16 and online FP8; with FP8 also the small bodies' CPU work in the
#        thread pool (--cpu-inline-bytes 0) against the new default (on the event loop).
# PLAN=thirtyseventh1 (one GPU; ~1,500 s): the GDN bodies without mask multiplies checked against vLLM's path (tiny);
#        --engine-core thread paired against the default (FP8, short c=1 then c=16/64); one short
#        decision's engine time at c=1 split by the worker's step events (CLEF_VLLM_TRACE; no profiler), FP8 and BF16
#        with the state cache on; the FP8 step profiled (48 fewer kernels a step expected).
# PLAN=fiftyeighth1 (one GPU; ~700 s; not run yet): the caching allocator's free blocks under load (~9 GiB beyond
#        vLLM's budget at c=64 in the thirty-fourth and thirty-fifth sessions): the default against the same server
#        with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (bench/paired.sh's ENV_<NAME>), short c=16/64,
#        16 blocks of 5 s a point; each server's `clef memory` lines (server_*.log) give what it held.
# PLAN=fiftyseventh2 (one GPU; ~450 s): FlashInfer's GDN prefill through the server on Hopper: a 9B server with
#        --gdn-prefill-backend flashinfer (started first: it JIT-compiles at its first forward) and the default,
#        one short decision at a time, 200 pairs. Stage with EXTRA_WHEELS="nvidia-cutlass-dsl==4.8.1
#        nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1"
#        (five parts) and put /root/site/nvidia_cutlass_dsl/dsl_packages on PYTHONPATH.
# PLAN=fiftyseventh1 (one GPU; ~950 s, ran 685 s in the thirty-fifth session, every job; the c=1 pair after it by hand): what fiftysixth2 could not finish, at c=16 and c=64: the default
#        (GDN kernels tuned per shape class) against raw vLLM with its own tuning, and against --gdn-tuning off (the
#        tuning's own effect; that server starts second and tunes at 64 tokens itself, raw then reads its disk cache:
#        vLLM's own behaviour), 16 blocks of 5 s a point, on a fresh machine.
# PLAN=fiftysixth2 (one GPU; ~650 s; ran in the thirty-fourth session: its first comparison; the device time ran out
#        in the second): fiftysixth1 again at c=64 after its finding: vLLM turns on Triton's disk cache
#        of autotuning results, so the tuned server (started first) had written its last class's choices for every
#        later process on the machine: --gdn-tuning off and raw vLLM ran them too (both matched the tuned server).
#        The classed tuners now neither read nor write that cache: the default against raw vLLM and against
#        --gdn-tuning off at c=64, 16 blocks of 5 s a point, on a fresh machine.
# PLAN=fiftysixth1 (one GPU; ~1,150 s; ran in the thirty-fourth session, every job): the GDN kernels tuned per shape class at start-up (--gdn-tuning, the new
#        default; bench/gdn_configs.py timed every config at each step shape: vLLM's one tuning at 64 tokens costs
#        a 41-request step ~10.8 ms) and the span sums over span rows only (~0.9 ms of a 41-request step's head):
#        two servers at 0.25 of the GPU, the default against raw vLLM at c=16/64 and against --gdn-tuning off at
#        c=64, 16 blocks of 5 s a point (the server logs say what the tuning chose, how long it took, and any
#        kernel tuned later at a first call); then the tiny parity (240 requests a layout).
# PLAN=fiftyfifth1 (one GPU; ~750 s; not run yet): c=64's last ~1 % (thirty-third session: 99.0 % of raw in two runs,
#        raw faster in every pair): two servers at 0.25 of the GPU each (three at 0.28 left raw too little, fiftyfourth1),
#        the default and --head-graph-records 64 (a c=64 step's 41 or 23 finishing requests decided from a graph, not
#        the eager head), each against raw vLLM at c=64 and against each other, 16 blocks of 5 s a point; the servers'
#        logs now say each full garbage collection of 50 ms or more and each event-loop timer 100 ms late (hold
#        them against bench/cohorts.py's late groups, `--blocks` with the run's clef-bench JSON; clef-bench's
#        blocks now also record their clients' own loop stalls and start times) and what each engine holds under load (`clef memory:` lines, every GiB more: the driver's count
#        for the process where NVML lists it, and the allocator's).
# PLAN=fiftyfourth2 (one GPU; ~600 s; ran twice in the thirty-third session): fiftyfourth1's first comparison on its own (there, three servers at 0.28 of the
#        GPU each held 48-49 GiB, so raw vLLM's engine found 12.9 GiB free and did not start, and the async server ran
#        out of memory at c=64): the default server against raw vLLM at c=16/64, 16 blocks of 5 s a point, the
#        worker's memory ledger in its log ("clef memory:" lines: what the plugin's graphs and warm-up took after
#        vLLM sized its KV cache).
# PLAN=fiftyfourth1 (one GPU; ~850 s; ran in the thirty-third session: the raw comparison failed, see fiftyfourth2): the default server (the split, start-up's objects frozen out of
#        the garbage collector's scans, clef-bench's own heap frozen while it measures) against raw vLLM at c=16/64,
#        16 blocks of 5 s a point; its access log's cohorts (do the ~300 ms holds at c=64 go?); then --gc-freeze off
#        against the default at c=64 (clef_gc_pause_seconds in each server's metrics_NAME.txt), and the default
#        against --async-scheduling on at c=64 (async's extra small steps now replay from the step graphs).
# PLAN=fiftythird2 (one GPU; ~400 s): fiftythird1's tiny check again, each request's answer alone now from its step
#        graph's replay (its third run), then the tiny parity (240 requests a layout) with the split on.
# PLAN=fiftythird1 (one GPU; ~900 s; ran in the thirty-second session, every job): small batches replayed one sequence at a time (--step-graph-split, default 4):
#        the tiny GPU check first (a group of up to 4 requests answers bit-identically to its requests alone),
#        then the default server against raw vLLM at c=16/64 and against --step-graph-split 0 at c=4/16,
#        16 blocks of 5 s a point (issue 12's c=16/64 target: the c=16 cohorts' small steps ran ~66 ms for
#        ~30 ms of GPU work).
# PLAN=fiftysecond1 (one GPU; ~450 s; not run yet): the clients' cohorts on both sides: the default server against raw
#        vLLM at c=16/64, 16 blocks of 5 s a point, with clef-bench's per-block answer groups (answers per group A
#        and B: do raw's in-process clients stay in one cohort where the server's split?).
# PLAN=fiftyfirst1 (one GPU; ~1,500 s by priority; ran in the thirty-first session, every job): issue 12's c=16/64 target with vLLM's async scheduling on top of
#        the row grid (the thirtieth session's profile: ~12 ms a step of host-bound input preparation between a
#        step's last kernel and the next step's GEMMs, on both sides): the default server against
#        --async-scheduling on at c=16/64, each against raw vLLM (16 blocks of 5 s a point, clef-bench's steady
#        reading beside req/s), the async server's engine core profiled at c=64, FP8 short c=1 (the 20 ms target)
#        with --gemm-row-grid off / the default / --async-scheduling on, the tiny parity with async scheduling.
# PLAN=fiftieth2 (one GPU; ~750 s by priority; ran in the thirtieth session, every job): fiftieth1's jobs after its first (its machine was handed back while
#        idle between two calls): grid against --gemm-row-grid off at c=64, the grid server's engine core profiled
#        at c=64, the tiny parity, raw vLLM's engine core profiled at c=64 on the same machine.
# PLAN=fiftieth1 (one GPU; ~1,100 s by priority; thirtieth session: its first job ran): --gemm-row-grid (the head's GEMMs outside its
#        graphs at the warm-up's row counts): the default server against raw vLLM in time blocks at c=16/64 (issue
#        12's c=64 target: 98.3 % before), against the same server with --gemm-row-grid off at c=64; the tiny
#        parity and the state cache's GPU cases with it; its engine core profiled at c=64 (lazy loads a step).
# PLAN=fortyninth2 (one GPU; ~300 s; ran in the twenty-ninth session): the new default FP8 server once more on a fresh machine, paired at c=1 with
#        --engine-core thread (the target's other route to 20 ms).
# PLAN=fortyninth1 (one GPU; ~1,150 s by priority; ran in the twenty-ninth session, every job): the state lines read from the block table, not gathered
#        (the state cache's cost on a short step) and a replay's inputs refreshed in one copy per dtype: the state
#        cache's GPU cases first (exactness where the lines come from a cached state), then the default FP8 server
#        paired with --state-cache off at c=1 (the cost was 1.020x), its steps' Python calls again, the tiny
#        parity with the defaults, the metadata memo's replays.
# PLAN=fortyeighth2 (one GPU; ~800 s by priority; its first job ran in the twenty-eighth session, the profiles in the
#        twenty-ninth with SKIP=server_dp2_1gpu): two engines on the one GPU answer as one engine offline (the tiny
#        checkpoint, 256 requests at c=1/16/64 through `--dp 2 --engines-per-gpu 2`, each response against the same
#        request answered offline); then one short FP8 decision's steps with the profiler's Python tracer, the state
#        cache on and off (where its 0.45 ms goes).
# PLAN=fortyeighth1 (one GPU; ~1,300 s by priority; ran in the twenty-eighth session): two data-parallel engines on the one GPU (--engines-per-gpu 2):
#        the shared-state hits they keep with state affinity against one engine (issue 13's DP=2 target, on the
#        one GPU lent), then short decisions at c=16/64 through them against raw vLLM in time blocks.
# PLAN=fortyseventh2 (one GPU; ~450 s by priority): what the state cache (now the default) costs one short FP8
#        decision at c=1 (the 20 ms target), then BF16 against FP8 follow-ups on a cached 16k state with the head's
#        matmul route (fortyseventh1's last two jobs, cut when that machine was handed back).
# PLAN=fortyseventh1 (one GPU; ran in the twenty-seventh session, its first three jobs; its queue is removed): the
#        new defaults checked (the state cache on, the head's matmul route over memories of 1,024 rows or more): the
#        tiny parity (240 requests per layout) and the state cache's GPU cases; a 16k follow-up's steps profiled
#        again (FP8).
# PLAN=fortysixth1 (one GPU; ran in the twenty-sixth session, every job; its queue is removed): a 16k follow-up's
#        steps profiled (FP8, state cache on); FP8 with the 480 bucket beside raw vLLM FP8 at c=1 and --engine-core
#        thread against it; the state cache's cost on unique short decisions at c=16/64; BF16 against FP8
#        follow-ups on a cached 16k state.
# PLAN=fortyfifth1 (one GPU; ran in the twenty-fifth session, every job; its queue is removed): first the state cache's
#        FP8 follow-up on a cached 16k state (its default waits on it; cut by a leftover engine in the twenty-fourth
#        session); the tiny parity with the head's grouped decisions (240 requests per layout, against the
#        twenty-second session's 0.0076 / 0.0097 max |dp|); then --gemm-warmup on (the head's GEMM kernels loaded at the first step) paired against off at
#        c=16/64 and against raw vLLM at c=16/64 (the target: >= 100 %; 95.5 / 97.5 % without), its engine core
#        profiled at c=64 (lazy loads per step: bench/step_timeline.py --gaps); then warm-up with and without
#        async scheduling (c=16/64); last fortythird1's FP8 sweep and planned pair.
# PLAN=fortyfourth1 (one GPU; ran in the twenty-fourth session; its queue is removed with --cuda-module-loading,
#        whose eager engines could not start in time): the tiny Hybrid's answers
#        with --nvfp4-kernel bf16 against Marlin's (fortythird1's check, which ran out of time); then CUDA's kernel
#        loading: the 9B BF16 server with --cuda-module-loading eager paired against the default (lazy) at c=1 and
#        c=16/64 (the servers' logs hold their start times and memory), the eager server against raw vLLM at
#        c=16/64 (the target: >= 100 %; 95.5 / 97.5 % lazy), and its engine core profiled at c=64 (no mid-step
#        kernel loads expected: bench/step_timeline.py --gaps); then fortysecond1's FP8 follow-ups with the state
#        cache (its default waits on them), eager against eager with async scheduling (c=16/64), and
#        fortythird1's FP8 sweep and planned pair (the sweep failed there).
# PLAN=fortythird1 (one GPU; ~2,400 s by priority, the last jobs may be cut; ran in the twenty-third session): first the NVFP4 layers as
#        BF16 GEMMs on weights dequantized at load (--nvfp4-kernel bf16): the tiny Hybrid's answers against Marlin's
#        (tests/gpu/fast_paths.py --only nvfp4), the 9B Hybrid served with each, paired (c=1, c=16/64), and in
#        process with bf16 (against the twenty-second session's Marlin run: 22.4 ms, 31,853 tok/s); then the rest
#        below, after the pairs with raw vLLM moved up:
#        online FP8's step cost measured at every 16 tokens from 368 to
#        528 (bench/latency.py --sweep; its default buckets came from a GEMM model) and, when the plan it gives
#        (bench/bucket_plan.py for 384-416 tokens, the short workload) pads differently from the default, that
#        plan paired against the default at c=1 (the 20 ms target: 20.7 ms paired); the state cache's GPU cases
#        on the tiny checkpoint with today's code (the packed head spec with reuse fields has not run on a GPU);
#        head graphs for steps finishing up to 64 requests paired against the default 16 at c=16/64 (at c=64
#        steps finish 21-41 requests and run the head eagerly) and the default paired against raw vLLM itself
#        (bench/paired.sh's `raw`: clef-bench --versus-raw) at c=1/16/64, where single runs put the server at
#        90.5-98.2 % of raw; the default server's and raw vLLM's engine cores profiled at c=64.
#        (~1,500 s expected, limits 2,320 s: the profiles at the end may be cut.)
# PLAN=fortysecond1 (one GPU; ~1,350 s; not run yet): measured bucket sweeps (bench/latency.py --sweep 256:1024:16, a
#        bucket at every 16 tokens, one request of each size; read by bench/bucket_plan.py): the 9B-shaped Hybrid
#        (--load-format clef-dummy: its buckets are the generic ones, its kernels never swept) and BF16 (against the
#        GEMM model's plan, whose 400 bucket won in pairs); then the state cache's follow-ups with online FP8
#        (step scope; not measured since it became the default); last, the 2 ms
#        batch wait (the default since the twenty-first session) paired against none at c=4/8, where a step holds
#        a few requests and a held request may wait up to 2 ms (measured only at c=1, 16 and 64 so far).
# PLAN=fortyfirst1 (one GPU; ~1,400 s; not run yet): the 240-request parity with today's defaults (both layouts; the
#        twenty-first session's last call finished only the release layout's 120), the FP8 default paired against
#        the previous defaults (generic buckets, vLLM's cleanup step) at c=1 for the default's own p50 next to the
#        20 ms target, the 9B-shaped Hybrid (FP8 W8A8 layers 0-16, NVFP4 17-31 as Marlin W4A16 on Hopper;
#        --load-format clef-dummy) next to raw vLLM for the first time (short c=1/16/64), and the engine cores of
#        the default server and of raw vLLM profiled at c=64 (where the server reaches 90.8 % of raw).
# PLAN=fortieth1 (one GPU; ~560 s; ran in the twenty-first session): the defaults after thirtyninth1 (buckets by the linear kernels: BF16 adds 400,
#        online FP8 pads to 464 instead of 448; the 2 ms batch wait) next to raw vLLM: short BF16 c=1/16/64, FP8 c=1.
# PLAN=thirtyninth1 (one GPU; ~1,600 s; ran in the twenty-first session): the scheduler's rule 4 (no engine step only to drop finished
#        requests) paired against --idle-cleanup-step on (vLLM's step), FP8 short c=1; rule 5 (--batch-wait-ms 2)
#        paired against the default, BF16 short c=16/64; buckets from bench/bucket_plan.py
#        paired against the default at c=1 (BF16: 400 added, FP8: 464 for 448); the default FP8 server traced.
# PLAN=thirtyeighth2 (one GPU; ~560 s; ran in the twentieth session): the memo test again, comparing two replays (a step that captures a step
#        graph runs the per-layer path itself); the default FP8 server paired against --gdn-metadata-memo off at c=1.
# PLAN=thirtyeighth1 (one GPU; ~1,000 s; ran in the twentieth session): the GDN metadata memo checked (tiny: repeats bit-identical on
#        vLLM's path and with the graphs) and its share of a short FP8 step traced (runner and output events); the
#        step's Python calls profiled (CLEF_VLLM_PROFILE=...,stack, bench/py_calls.py); then
#        the engine core in a thread (its engine requests now built in the caller's thread) and with
#        --engine-thread-switch-ms 0.5 (ran in the twentieth session; the option was removed after it, so that server
#        fails now), each paired against the default (its own process) at c=16/64 (where the
#        thread lost 12-15 %), then the two threads against each other at c=1 (where the thread won).
# PLAN=thirtyseventh2 (one GPU; ~600 s): one FP8 decision's engine time at c=1 split by the model runner's own steps
#        (CLEF_VLLM_TRACE's runner events) with py-spy sampling the engine core (PYSPY_BIN: py-spy, staged by hand;
#        it saw one unchanging stack per thread, so gpu_bench.sh's PYSPY knob was removed and is ignored now);
#        --engine-core thread paired against the default with BF16 at c=1.
# PLAN=thirtysixth1, thirtysixth2 (one GPU, after thirtyfifth1 on the same machine; ~650 s and ~300 s): the FP8 server's
#        engine core profiled at c=1 and the state cache with FP8 beside BF16 on one 16k state; --eager-batches at c=64.
#        (--eager-batches was removed after these runs, which measured no gain: thirtyfifth1's and thirtysixth2's
#        jobs with it are the record of what ran, and fail now.)
# PLAN=twentyfirst (two GPUs; not run yet): the shared-state sweep with DP=2 (unit matching, state affinity), then
#        short DP=2 vs raw DP=2.
# DRY=1 replaces every job by a short sleep (to test this script without a GPU). SKIP=NAME,NAME... skips those
# jobs: after a machine was handed back mid-plan, launch the plan again on the new one without the jobs whose
# results already came back (each `wait` packs what has finished into $OUT as jobs end).
set -uo pipefail
cd "$(dirname "$0")/.."
S=${SESSION_DIR:-/root/session}
mkdir -p "$S"
[ -f /root/site/vllm/__init__.py ] && source tests/gpu/env.sh
export PYTHONUNBUFFERED=1

log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$S/session.log"; }

job() {  # job NAME GPUS LIMIT_S CMD... : runs CMD with OUT=$S/NAME, records rc and seconds
  local name=$1 gpus=$2 limit=$3; shift 3
  if [[ ",${SKIP:-}," == *",$name,"* ]]; then   # SKIP=a,b: jobs whose results came back from a machine since lost
    log "job $name skipped (SKIP)"
    return 0
  fi
  if [ -e "$S/$name/rc.json" ]; then   # its command names its output folder too: a second run would overwrite it
    log "job $name already ran in this session: not run again (give it another name)"
    return 1
  fi
  mkdir -p "$S/$name"
  log "start $name (GPU $gpus, limit ${limit}s)"
  local t0=$SECONDS rc
  if [ -n "${DRY:-}" ]; then
    sleep 1; echo "dry: $*" >"$S/$name/job.log"; rc=0
  else
    # its own process group (setsid: pid = group id), so whatever it leaves running goes with it and the next
    # job gets a clean GPU (the twenty-fourth session lost a job to an engine its stopped server had left)
    OUT=$S/$name CUDA_VISIBLE_DEVICES=$gpus setsid timeout -k 20 "$limit" "$@" >"$S/$name/job.log" 2>&1 &
    local pid=$! left
    wait "$pid"; rc=$?
    left=$(pgrep -g "$pid" | tr '\n' ' ')
    if [ -n "$left" ]; then
      log "job $name left processes running (pids $left): killed"
      ps -o pid=,etimes=,args= -p "$(echo $left | tr " " ",")" 2>/dev/null | cut -c1-200 >>"$S/$name/job.log"
      kill -9 -- "-$pid" 2>/dev/null
      sleep 2
    fi
  fi
  echo "{\"job\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0)), \"command\": \"$*\"}" >"$S/$name/rc.json"
  log "end $name rc=$rc after $((SECONDS - t0))s"
}

TINY=$S/ckpt/tiny
NINE=$S/ckpt/9b
HYBRID=$S/ckpt/9b-hybrid   # the 9B config with the Hybrid's compressed-tensors config (split 17), no weights
NINE_SWEEP=(WORKLOADS=short,long,fanout CONC=1,16,64 "CONC_OVERRIDES=long=1,8 fanout=1,8" TIME_LIMIT=6 WARMUP=4
            READY_TIMEOUT=360 BENCH_TIMEOUT=240)
TINY_SWEEP=(WORKLOADS=short,long CONC=1,16,64 "CONC_OVERRIDES=long=1,8" TIME_LIMIT=5 WARMUP=4
            READY_TIMEOUT=300 BENCH_TIMEOUT=200)
PLAN=${PLAN:-all}
B=$(case "$PLAN" in *1) echo 0 ;; *) echo 1 ;; esac)   # the second queue's GPU (0 on the one-GPU machine)
full=$([ "$PLAN" = bench ] && echo 0 || echo 1)   # 1: every job; 0: the clef-bench jobs only
# PLAN=reuse / sixthb / eighth*: the state-cache sweep. One-state variants are measured hot (their warm-up caches
# the state); the 32-state variant has one point only, so its hits are the follow-ups of that point.
# The 32-state variant asks three times about each state: under the default --state-cache-admit repeat a
# state's first request is not cached, its second is, its third hits (until the sixth session: 4096x64x32).
SHARED_STATES="--shared-states 4096x64,15872x33,4096x96x32"
# TIME_LIMIT 15: the 32-state variant's 96 requests take ~11 s uncached; cut at 6 s (seventh session: 64 of 96
# sent) its third round, the one that hits, never ran.
SHARED=(WORKLOADS=shared-state CONC=1,16,64 "CONC_OVERRIDES=shared-4k-32s=16" TIME_LIMIT=15 WARMUP=4
        READY_TIMEOUT=360 BENCH_TIMEOUT=400 "BENCH_ARGS=$SHARED_STATES")

cache_on_9b() {  # the shared-state sweep plus the unique-state workloads against --state-cache on, GPU 0
  job cache_on_9b_bf16 0 600 env "${SHARED[@]}" WORKLOADS=shared-state,short,long,fanout \
      "BENCH_ARGS=$SHARED_STATES --unique-per-point" \
      "CONC_OVERRIDES=shared-state=1,16,64 shared-4k-32s=16 long=1,8 fanout=1,8" CONC=1,16,64 PHASES=server \
      LABEL=9b-dummy-bf16-cache-on SERVER_ARGS="--load-format dummy --state-cache on" bash bench/gpu_bench.sh "$NINE" 8711
}

cache_on_9b_dp2() {  # the shared-state sweep against --state-cache on with DP=2 (affinity), both GPUs
  job cache_on_9b_bf16_dp2 0,1 600 env "${SHARED[@]}" PHASES=server LABEL=9b-dummy-bf16-cache-on-dp2 \
      SERVER_ARGS="--load-format dummy --state-cache on --data-parallel-size 2" bash bench/gpu_bench.sh "$NINE" 8713
}

cache_off_9b_unique() {  # the unique-state workloads against --state-cache off (the 3 % comparison), GPU 1
  job cache_off_9b_bf16_unique "$B" 600 env "${NINE_SWEEP[@]}" PHASES=server LABEL=9b-dummy-bf16-cache-off \
      SERVER_ARGS="--load-format dummy" BENCH_ARGS=--unique-per-point bash bench/gpu_bench.sh "$NINE" 8732
}

cache_on_9b_fp8() {  # the shared-state sweep against --state-cache on, online FP8, GPU 1
  job cache_on_9b_fp8 "$B" 500 env "${SHARED[@]}" PHASES=server LABEL=9b-dummy-fp8-cache-on \
      SERVER_ARGS="--load-format dummy --quantization fp8 --state-cache on" bash bench/gpu_bench.sh "$NINE" 8723
}

latency_cache() {  # latency.py graphs vs cache in process (follow-ups on a cached 16k state), GPU 0
  job latency_cache 0 420 python3 bench/latency.py --modes graphs,cache --ckpt "$NINE" \
      --out "$S/latency_cache/latency.json"
}

cache_gpu_cases_tiny() {  # the state cache's GPU cases on the tiny checkpoint (fast_paths: cache, eviction), GPU 1
  job cache_cases_tiny "$B" 360 python3 tests/gpu/fast_paths.py --out "$S/cache_cases_tiny" --only cache,eviction
}

tuning_pairs() {  # tuning_pairs LIMIT_S PORT0 COMPARE: the default (GDN kernels tuned per class) and --gdn-tuning off,
  # two 9B servers at 0.25 of the GPU, 16 blocks of 5 s a point (the default starts first: it writes no disk cache)
  job paired_tune 0 "$1" env COMPARE="$3" PAIRS=2000 \
      TIME_LIMIT=20 PORT0="$2" GPU_SHARE=0.25 "BENCH_ARGS=--blocks 16 --block-seconds 5" bash bench/paired.sh "$NINE" \
      "dflt=--load-format dummy" "notune=--load-format dummy --gdn-tuning off"
}
cache_parity_tiny() {  # clef-parity: the tiny server with the cache on vs the reference backend (the receipt), GPU 1
  job cache_parity_tiny "$B" 420 env PHASES=parity LABEL=tiny-cache-on READY_TIMEOUT=300 BENCH_TIMEOUT=300 \
      SERVER_ARGS="--state-cache on" \
      "PARITY_ARGS=--synthetic 96 --synthetic-states 12 --synthetic-max-words 2500 -c 8 --device cuda" \
      bash bench/gpu_bench.sh "$TINY" 8731
}

cache_on_9b_block() {  # the shared-state sweep with hits at whole blocks only (the previous rule), GPU 1
  job cache_on_9b_bf16_block "$B" 500 env "${SHARED[@]}" PHASES=server LABEL=9b-dummy-bf16-cache-on-block \
      SERVER_ARGS="--load-format dummy --state-cache on --state-cache-match block" bash bench/gpu_bench.sh "$NINE" 8724
}

traced_9b() {  # traced_9b NAME LIMIT PORT LABEL CONC [VAR=VALUE...]: the 9B BF16 server with the cache on and
  # CLEF_VLLM_TRACE, shared-state (4k, 16k) and short at CONC (VAR=VALUE overrides), then the trace's summary
  local name=$1 limit=$2 port=$3 label=$4 conc=$5; shift 5
  job "$name" 0 "$limit" env CLEF_VLLM_TRACE="$S/$name/trace.jsonl" WORKLOADS=shared-state,short CONC="$conc" \
      CONC_OVERRIDES= TIME_LIMIT=6 WARMUP=3 READY_TIMEOUT=300 BENCH_TIMEOUT=300 \
      "BENCH_ARGS=--shared-states 4096x64,15872x33" PHASES=server LABEL="$label" \
      SERVER_ARGS="--load-format dummy --state-cache on" "$@" bash bench/gpu_bench.sh "$NINE" "$port"
  python3 -m clef_vllm.util.trace "$S/$name/trace.jsonl" >"$S/$name/trace_summary.txt" 2>&1
}

planned_pair_fp8() {  # the FP8 sweep's bucket plan for the short workload, paired against the default at c=1
  local plan=$S/sweep_fp8/plan.txt buckets
  if [ -n "${DRY:-}" ]; then
    buckets=64,128,192,256,320,384,400,512,640,768,1024,1280,1536,2048,3072,4096
  else
    [ -f "$S/sweep_fp8/latency.json" ] || { log "no FP8 sweep: no planned pair"; return 0; }
    python3 bench/bucket_plan.py "$S/sweep_fp8/latency.json" --lengths 384:416 --keep 3 >"$plan" 2>&1
    buckets=$(sed -n 's/^--prefill-graph-buckets //p' "$plan")
    [ -n "$buckets" ] || { log "the FP8 sweep gave no bucket plan (see $plan): no planned pair"; return 0; }
    if ! python3 bench/bucket_plan.py --differs "$buckets" --linear fp8 --lengths 384:416 >>"$plan" 2>&1; then
      log "the FP8 plan pads 384-416 tokens as the default does: no planned pair"
      return 0
    fi
  fi
  job paired_planned_fp8 0 360 env COMPARE="fp8:fp8plan:short" PAIRS=200 TIME_LIMIT=20 PORT0=9270 \
      bash bench/paired.sh "$NINE" "fp8=--load-format dummy --quantization fp8" \
      "fp8plan=--load-format dummy --quantization fp8 --prefill-graph-buckets $buckets"
}

profiled_9b() {  # profiled_9b NAME PORT LABEL SERVER_ARGS [CONC [WINDOW [LIMIT_S]]]: the 9B server, short at c=CONC (1), its
  # engine core torch-profiled over client decisions WINDOW (8,5: decisions 8-12; CLEF_VLLM_PROFILE: vLLM's per-op
  # table profiler_out_0.txt and traces; traces over 20 MB are dropped so the session's results stay small)
  # (PROFILE_PHASES=raw profiles clef-bench's raw vLLM baseline instead: its window counts the warm-up's requests too;
  # PROFILE_WORKLOADS [short] and PROFILE_BENCH_ARGS [none] choose other requests, e.g. follow-ups on a shared state)
  local name=$1 port=$2 label=$3 args=$4 conc=${5:-1} window=${6:-8,5} limit=${7:-240}
  mkdir -p "$S/$name/profile"
  job "$name" 0 "$limit" env CLEF_VLLM_PROFILE="$S/$name/profile,$window" WORKLOADS="${PROFILE_WORKLOADS:-short}" \
      BENCH_ARGS="${PROFILE_BENCH_ARGS:-}" CONC="$conc" CONC_OVERRIDES= TIME_LIMIT=6 \
      WARMUP=4 READY_TIMEOUT=300 BENCH_TIMEOUT=200 PHASES="${PROFILE_PHASES:-server}" LABEL="$label" SERVER_ARGS="$args" \
      bash bench/gpu_bench.sh "$NINE" "$port"
  local trace
  for trace in "$S/$name"/profile/*.pt.trace.json*; do    # when each step launches its graphs (bench/step_timeline.py)
    [ -f "$trace" ] && python3 bench/step_timeline.py "$trace" --gaps --kernels --json "$S/$name/timeline.json" \
        >"$S/$name/timeline.txt" 2>&1
    # a window recorded with Python stacks (WINDOW ending in ",stack"): which Python code the steps' host time goes to
    [[ -f "$trace" && $window == *,stack ]] && python3 bench/py_calls.py "$trace" --depth 6 \
        --json "$S/$name/py_calls.json" >"$S/$name/py_calls.txt" 2>&1
  done
  find "$S/$name/profile" -type f -size +20M -delete 2>/dev/null
}

phase_a_done() {  # phase_a_done GPU: this queue's first stage is over; wait for the other queue's
  touch "$S/phase_a.$1"
  while [ ! -f "$S/phase_a.0" ] || [ ! -f "$S/phase_a.1" ]; do sleep 2; done
}

tiny_dp1() {  # tiny_dp1 GPU: tiny clef-bench server vs raw (the full plan adds clef-parity vs the reference)
  job bench_tiny_dp1 "$1" 420 env "${TINY_SWEEP[@]}" PHASES=server,"$( (( full )) && echo parity,)"raw,compare \
      LABEL=tiny-dp1 bash bench/gpu_bench.sh "$TINY" 8703
}

case "${1:-}" in
queue0|queue1)
  # a plan with its own queues has the case label PLAN_queue0 below (and PLAN_queue1 when it uses a second
  # GPU: without one, its queue1 runs nothing); the others run the default queues
  grep -q "^${PLAN}_queue0)" "$0" && set -- "${PLAN}_$1" ;;
esac
SHORT=(WORKLOADS=short CONC=1,16,64 CONC_OVERRIDES= TIME_LIMIT=6 WARMUP=4 READY_TIMEOUT=360 BENCH_TIMEOUT=200)

case "${1:-}" in
reuse_queue0)
  job bench_9b_bf16 0 600 env "${NINE_SWEEP[@]}" LABEL=9b-dummy-bf16 SERVER_ARGS="--load-format dummy" \
      BENCH_ARGS=--unique-per-point bash bench/gpu_bench.sh "$NINE" 8701
  cache_on_9b
  touch "$S/queue0.done"
  while [ ! -f "$S/queue1.done" ]; do sleep 2; done
  cache_on_9b_dp2
  touch "$S/all.done"
  log "all done"
  ;;
reuse_queue1)
  job parity_tiny 1 420 python3 tests/gpu/vllm_parity.py --out "$S/parity_tiny" --n 240 --skip-server
  job fast_paths 1 360 python3 tests/gpu/fast_paths.py --out "$S/fast_paths" --n 16 --only graphs,api
  job cache_off_9b_bf16 1 600 env "${SHARED[@]}" PHASES=server LABEL=9b-dummy-bf16-cache-off \
      SERVER_ARGS="--load-format dummy" bash bench/gpu_bench.sh "$NINE" 8712
  touch "$S/queue1.done"
  ;;
sixthb_queue0)
  latency_cache
  phase_a_done 0
  cache_on_9b_dp2
  job short_9b_bf16_dp2 0,1 420 env "${SHORT[@]}" LABEL=9b-dummy-bf16-dp2 \
      SERVER_ARGS="--load-format dummy --data-parallel-size 2" RAW_ARGS="--raw-engine-arg data_parallel_size=2" \
      bash bench/gpu_bench.sh "$NINE" 8705
  touch "$S/all.done"
  log "all done"
  ;;
sixthb_queue1)
  job context_filling_chunked 1 300 env WORKLOADS=long CONC=1 "CONC_OVERRIDES=long=1" TIME_LIMIT=4 WARMUP=1 \
      READY_TIMEOUT=360 BENCH_TIMEOUT=200 PHASES=server LABEL=9b-dummy-bf16-chunk4096 "BENCH_ARGS=--long-tokens 16384" \
      SERVER_ARGS="--load-format dummy --max-num-batched-tokens 4096" bash bench/gpu_bench.sh "$NINE" 8741
  phase_a_done 1
  ;;
eighth_queue0)
  cache_on_9b
  latency_cache
  phase_a_done 0
  cache_on_9b_dp2
  touch "$S/all.done"
  log "all done"
  ;;
eighth_queue1)
  cache_gpu_cases_tiny
  cache_parity_tiny
  cache_off_9b_unique
  cache_on_9b_block
  cache_on_9b_fp8
  phase_a_done 1
  ;;
eighth1_queue0)
  cache_gpu_cases_tiny
  cache_on_9b
  cache_off_9b_unique
  cache_on_9b_block
  cache_parity_tiny
  latency_cache
  touch "$S/all.done"
  log "all done"
  ;;
eighth1_queue1|ninth1_queue1|eleventh1_queue1|twelfth1_queue1|thirteenth1_queue1|fourteenth1_queue1|fifteenth1_queue1|sixteenth1_queue1|seventeenth1_queue1|eighteenth1_queue1|nineteenth1_queue1|twentieth1_queue1|twentyfirst1_queue1|twentyfirst_queue1|twentysecond1_queue1|twentythird1_queue1|twentyfourth1_queue1|twentyfifth1_queue1|twentysixth1_queue1|twentyseventh1_queue1|twentyeighth1_queue1|twentyninth1_queue1)
  ;;
fifteenth1_queue0)
  job head_graphs 0 240 python3 tests/gpu/head_graphs.py --out "$S/head_graphs" --n 200
  job latency_headgraphs 0 420 python3 bench/latency.py --modes graphs,eagerhead --ckpt "$NINE" \
      --out "$S/latency_headgraphs/latency.json"
  job latency_headgraphs_fp8 0 300 python3 bench/latency.py --modes graphs --quantization fp8 --ckpt "$NINE" \
      --out "$S/latency_headgraphs_fp8/latency.json"
  job short_9b_bf16 0 420 env "${SHORT[@]}" LABEL=9b-dummy-bf16-headgraphs-short SERVER_ARGS="--load-format dummy" \
      bash bench/gpu_bench.sh "$NINE" 8811
  job parity_tiny 0 420 python3 tests/gpu/vllm_parity.py --out "$S/parity_tiny" --n 240 --skip-server
  touch "$S/all.done"
  log "all done"
  ;;
seventeenth1_queue0)
  job head_graphs 0 240 python3 tests/gpu/head_graphs.py --out "$S/head_graphs" --n 200
  job short_9b_bf16 0 420 env "${SHORT[@]}" LABEL=9b-dummy-bf16-headgraphs-short SERVER_ARGS="--load-format dummy" \
      bash bench/gpu_bench.sh "$NINE" 8831
  job short_9b_bf16_eagerhead 0 420 env "${SHORT[@]}" PHASES=server LABEL=9b-dummy-bf16-eagerhead-short \
      SERVER_ARGS="--load-format dummy --head-graphs off" bash bench/gpu_bench.sh "$NINE" 8832
  job latency_headgraphs 0 420 python3 bench/latency.py --modes graphs,eagerhead --ckpt "$NINE" \
      --out "$S/latency_headgraphs/latency.json"
  job parity_tiny 0 420 python3 tests/gpu/vllm_parity.py --out "$S/parity_tiny" --n 240 --skip-server
  job short_9b_fp8 0 400 env "${SHORT[@]}" CONC=1 LABEL=9b-dummy-fp8-headgraphs-c1 \
      SERVER_ARGS="--load-format dummy --quantization fp8" RAW_ARGS="--raw-quantization fp8" bash bench/gpu_bench.sh "$NINE" 8833
  touch "$S/all.done"
  log "all done"
  ;;
eighteenth1_queue0)
  FOLLOW=(WORKLOADS=shared-state,short CONC=1 CONC_OVERRIDES= TIME_LIMIT=6 WARMUP=3 READY_TIMEOUT=360
          BENCH_TIMEOUT=300 "BENCH_ARGS=--shared-states 4096x64,15872x33" PHASES=server)
  job follow_9b_bf16 0 360 env "${FOLLOW[@]}" LABEL=9b-dummy-bf16-cache-on-c1 \
      SERVER_ARGS="--load-format dummy --state-cache on" bash bench/gpu_bench.sh "$NINE" 8841
  job follow_9b_fp8 0 360 env "${FOLLOW[@]}" LABEL=9b-dummy-fp8-cache-on-c1 \
      SERVER_ARGS="--load-format dummy --quantization fp8 --state-cache on" bash bench/gpu_bench.sh "$NINE" 8842
  job short_9b_fp8 0 300 env "${SHORT[@]}" CONC=1 PHASES=server LABEL=9b-dummy-fp8-headgraphs-c1b \
      SERVER_ARGS="--load-format dummy --quantization fp8" bash bench/gpu_bench.sh "$NINE" 8843
  job short_tiny 0 240 env "${SHORT[@]}" CONC=16,64 PHASES=server LABEL=tiny-headgraphs-short \
      bash bench/gpu_bench.sh "$TINY" 8844
  touch "$S/all.done"
  log "all done"
  ;;
nineteenth1_queue0)   # ~1,600 s of jobs in priority order: the last ones may not fit a session's device time
  job head_graphs_several 0 240 python3 tests/gpu/head_graphs.py --out "$S/head_graphs_several" --n 200 --records 16
  job short_9b_bf16_r16 0 420 env "${SHORT[@]}" LABEL=9b-dummy-bf16-headgraphs-r16-short \
      SERVER_ARGS="--load-format dummy --head-graph-records 16" bash bench/gpu_bench.sh "$NINE" 8851
  job short_9b_bf16_r1 0 300 env "${SHORT[@]}" PHASES=server LABEL=9b-dummy-bf16-headgraphs-r1-short \
      SERVER_ARGS="--load-format dummy" bash bench/gpu_bench.sh "$NINE" 8852
  job parity_tiny_r16 0 420 python3 tests/gpu/vllm_parity.py --out "$S/parity_tiny_r16" --n 240 --skip-server \
      --head-graph-records 16
  cache_gpu_cases_tiny          # unkeyed first sightings get no block hashes now: the cache's GPU cases again
  job latency_fp8 0 420 python3 bench/latency.py --modes graphs,raw --quantization fp8 --ckpt "$NINE" \
      --out "$S/latency_fp8/latency.json"
  job latency_fp8_process 0 360 python3 bench/latency.py --modes graphs,raw --quantization fp8 --engine-process \
      --ckpt "$NINE" --out "$S/latency_fp8_process/latency.json"
  job short_tiny_r16 0 240 env "${SHORT[@]}" CONC=16,64 PHASES=server LABEL=tiny-headgraphs-r16-short \
      SERVER_ARGS="--head-graph-records 16" bash bench/gpu_bench.sh "$TINY" 8853
  job latency_bf16_process 0 300 python3 bench/latency.py --modes graphs,raw --engine-process --ckpt "$NINE" \
      --out "$S/latency_bf16_process/latency.json"
  touch "$S/all.done"
  log "all done"
  ;;
twentyfirst1_queue0)   # twelfth session, round 1 (~800 s): where FP8 loses its in-process lead through the server (FP8
                       # and BF16 short c=1 traced, with the 4k/16k follow-ups), head graphs for up to 64 requests a
                       # step (the head alone; 9B short c=16/64 with 64, then the default 16 on the same machine),
                       # then the unique-state cost of the cache at c=1 (issue 13's 3 %)
  traced_9b trace_9b_fp8 300 8872 9b-dummy-fp8-trace-c1 1 "SERVER_ARGS=--load-format dummy --quantization fp8 --state-cache on"
  traced_9b trace_9b_bf16 300 8873 9b-dummy-bf16-trace-c1 1
  job head_graphs_64 0 240 python3 tests/gpu/head_graphs.py --out "$S/head_graphs_64" --n 200 --records 64
  job short_9b_bf16_r64 0 300 env "${SHORT[@]}" CONC=16,64 PHASES=server LABEL=9b-dummy-bf16-headgraphs-r64-short \
      SERVER_ARGS="--load-format dummy --head-graph-records 64" bash bench/gpu_bench.sh "$NINE" 8877
  job short_9b_bf16_r16 0 300 env "${SHORT[@]}" CONC=16,64 PHASES=server LABEL=9b-dummy-bf16-headgraphs-r16b-short \
      SERVER_ARGS="--load-format dummy" bash bench/gpu_bench.sh "$NINE" 8878
  UNIQUE_C1=(WORKLOADS=short,long CONC=1 "CONC_OVERRIDES=long=1" TIME_LIMIT=6 WARMUP=4 READY_TIMEOUT=360
             BENCH_TIMEOUT=240 BENCH_ARGS=--unique-per-point PHASES=server)
  job unique_c1_cache_on 0 300 env "${UNIQUE_C1[@]}" LABEL=9b-dummy-bf16-unique-c1-cache-on \
      SERVER_ARGS="--load-format dummy --state-cache on" bash bench/gpu_bench.sh "$NINE" 8874
  job unique_c1_cache_off 0 300 env "${UNIQUE_C1[@]}" LABEL=9b-dummy-bf16-unique-c1-cache-off \
      SERVER_ARGS="--load-format dummy" bash bench/gpu_bench.sh "$NINE" 8875
  touch "$S/all.done"
  log "all done"
  ;;
twentysecond1_queue0)  # twelfth session, round 2 (~700 s): unique-state traffic (every point its own states) on the
                       # default server vs raw vLLM (issue 12's long/fan-out "no regression"), the same with --state-cache on
                       # (issue 13's 3 %), then the default server again (the run-to-run spread between the two)
  job unique_off_vs_raw 0 560 env "${NINE_SWEEP[@]}" LABEL=9b-dummy-bf16-unique-off-vs-raw \
      SERVER_ARGS="--load-format dummy" BENCH_ARGS=--unique-per-point bash bench/gpu_bench.sh "$NINE" 8881
  job unique_on 0 400 env "${NINE_SWEEP[@]}" PHASES=server LABEL=9b-dummy-bf16-unique-cache-on \
      SERVER_ARGS="--load-format dummy --state-cache on" BENCH_ARGS=--unique-per-point bash bench/gpu_bench.sh "$NINE" 8882
  job unique_off_again 0 400 env "${NINE_SWEEP[@]}" PHASES=server LABEL=9b-dummy-bf16-unique-off-again \
      SERVER_ARGS="--load-format dummy" BENCH_ARGS=--unique-per-point bash bench/gpu_bench.sh "$NINE" 8883
  touch "$S/all.done"
  log "all done"
  ;;
twentythird1_queue0)   # twelfth session, round 3 (~200 s, ~350 s with the profiles): why a unique short request took ~6 ms longer with --state-cache
                       # on when short ran first (rounds 1 and 2) but not after shared-state (round 1's trace): traced, with
                       # the worker's graph counters on every engine_done, cache on (short first) then cache off
  traced_9b trace_unique_on 300 8891 9b-dummy-bf16-trace-unique-on 1 WORKLOADS=short,shared-state \
      "BENCH_ARGS=--shared-states 4096x64,15872x33 --unique-per-point"
  traced_9b trace_unique_off 240 8892 9b-dummy-bf16-trace-unique-off 1 WORKLOADS=short "BENCH_ARGS=--unique-per-point" \
      "SERVER_ARGS=--load-format dummy"
  profiled_9b profile_fp8 8893 9b-dummy-fp8-profile-c1 "--load-format dummy --quantization fp8"
  profiled_9b profile_bf16 8894 9b-dummy-bf16-profile-c1 "--load-format dummy"
  touch "$S/all.done"
  log "all done"
  ;;
twentysixth1_queue0)   # ~500 s: launch with `wait 480` in a 600 s call
  job step_graph_probe 0 400 python3 bench/step_graph_probe.py --out "$S/step_graph_probe"
  job fast_paths_layer 0 300 python3 tests/gpu/fast_paths.py --out "$S/fast_paths_layer" --n 60 --only graphs --scope layer
  job fast_paths_step 0 300 python3 tests/gpu/fast_paths.py --out "$S/fast_paths_step" --n 60 --only graphs --scope step
  touch "$S/all.done"
  log "all done"
  ;;
thirtythird1_queue0)   # ~1,650 s: launch with `wait 520` in a 600 s call, then `wait 540`, then what is left
  profiled_9b profile_c16 9001 9b-dummy-bf16-default-profile-c16 "--load-format dummy" 16 24,32 330
  # raw vLLM's steps at c=16: how many requests each takes (a server's clients settle into two cohorts per cycle,
  # bench/front_end_share.py; whether raw's do too decides what a merged step would gain)
  PROFILE_PHASES=raw profiled_9b profile_raw_c16 9004 9b-dummy-bf16-raw-profile-c16 "--load-format dummy" 16 24,32 300
  profiled_9b profile_fp8_c1 9002 9b-dummy-fp8-default-profile-c1 "--load-format dummy --quantization fp8" 1 8,5 300
  job short_9b_bf16_512 0 480 env "${SHORT[@]}" CONC=16,64 TIME_LIMIT=30 BENCH_TIMEOUT=240 \
      "BENCH_ARGS=--num-requests 512" LABEL=9b-dummy-bf16-default-short-512 SERVER_ARGS="--load-format dummy" \
      bash bench/gpu_bench.sh "$NINE" 9003
  job paired_cache_fp8 0 330 env COMPARE="bf16:fp8:shared-state" PAIRS=100 TIME_LIMIT=20 PORT0=9010 \
      "BENCH_ARGS=--shared-states 15872x17" bash bench/paired.sh "$NINE" \
      "bf16=--load-format dummy --state-cache on" "fp8=--load-format dummy --state-cache on --quantization fp8"
  touch "$S/all.done"
  log "all done"
  ;;
thirtyeighth1_queue0)   # ~1,000 s: launch with `wait 540` in the staging's last call, then `wait 540`
  job fast_paths_memo 0 300 python3 tests/gpu/fast_paths.py --out "$S/fast_paths_memo" --only memo --scope step
  traced_9b trace_fp8_memo 330 9141 9b-dummy-fp8-trace-memo-c1 1 WORKLOADS=short "BENCH_ARGS=" TIME_LIMIT=10 \
      "SERVER_ARGS=--load-format dummy --quantization fp8"
  # which Python code vLLM's input preparation runs (the profiler's Python tracer, two steps; bench/py_calls.py)
  profiled_9b profile_fp8_stack_c1 9142 9b-dummy-fp8-stack-profile-c1 "--load-format dummy --quantization fp8" 1 \
      8,2,stack 240
  # (fp8:fp8thread at c=16/64 again: the engine request is now built in the caller's thread; 0.880/0.851 before)
  job paired_thread_switch_fp8 0 600 env \
      COMPARE="fp8:fp8thread:short:16,64 fp8:fp8switch:short:16,64 fp8thread:fp8switch:short" PAIRS=200 \
      TIME_LIMIT=20 PORT0=9150 bash bench/paired.sh "$NINE" "fp8=--load-format dummy --quantization fp8" \
      "fp8thread=--load-format dummy --quantization fp8 --engine-core thread" \
      "fp8switch=--load-format dummy --quantization fp8 --engine-core thread --engine-thread-switch-ms 0.5"
  touch "$S/all.done"
  log "all done"
  ;;
fiftyeighth1_queue0)   # ~700 s: launch with `wait 520` in the staging's last call, then `wait 540` at once
  job paired_alloc 0 800 env COMPARE="dflt:exp:short:16,64" PAIRS=2000 TIME_LIMIT=20 PORT0=9590 GPU_SHARE=0.25 \
      ENV_exp=PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "BENCH_ARGS=--blocks 16 --block-seconds 5" \
      bash bench/paired.sh "$NINE" "dflt=--load-format dummy" "exp=--load-format dummy"
  touch "$S/all.done"
  log "all done"
  ;;
fiftyseventh2_queue0)   # ~450 s: stage with nvidia-cutlass-dsl (see the plan's comment), launch with `wait 520`
  job paired_fi 0 560 env COMPARE="dflt:fi:short:1" PAIRS=200 TIME_LIMIT=20 PORT0=9570 GPU_SHARE=0.25 \
      bash bench/paired.sh "$NINE" "fi=--load-format dummy --gdn-prefill-backend flashinfer" "dflt=--load-format dummy"
  touch "$S/all.done"
  log "all done"
  ;;
fiftyseventh1_queue0)   # ~950 s: launch with `wait 520` in the staging's last call, then `wait 540` at once
  tuning_pairs 1100 9550 "dflt:raw:short:16,64 notune:dflt:short:16,64"
  touch "$S/all.done"
  log "all done"
  ;;
fiftysixth2_queue0)   # ~650 s: launch with `wait 520` in the staging's last call, then `wait 540` at once
  tuning_pairs 900 9540 "dflt:raw:short:64 notune:dflt:short:64"
  touch "$S/all.done"
  log "all done"
  ;;
fiftysixth1_queue0)   # ~1,150 s: launch with `wait 520` in the staging's last call, then `wait 540` at once
  tuning_pairs 1000 9530 "dflt:raw:short:16,64 notune:dflt:short:64"
  job parity_tiny 0 420 python3 tests/gpu/vllm_parity.py --out "$S/parity_tiny" --n 240 --skip-server
  touch "$S/all.done"
  log "all done"
  ;;
fiftyfifth1_queue0)   # ~750 s: launch with `wait 520` in the staging's last call, then `wait 540` at once
  job paired_hg64 0 900 env COMPARE="dflt:hg64:short:64 dflt:raw:short:64 hg64:raw:short:64" PAIRS=2000 \
      TIME_LIMIT=20 PORT0=9520 GPU_SHARE=0.25 "BENCH_ARGS=--blocks 16 --block-seconds 5" bash bench/paired.sh "$NINE" \
      "dflt=--load-format dummy" "hg64=--load-format dummy --head-graph-records 64"
  touch "$S/all.done"
  log "all done"
  ;;
fiftyfourth2_queue0)   # ~600 s: launch with `wait 520` in the staging's last call, then `wait 540` at once
  job paired_raw 0 700 env COMPARE="dflt:raw:short:16,64" PAIRS=2000 TIME_LIMIT=20 PORT0=9510 \
      "BENCH_ARGS=--blocks 16 --block-seconds 5" bash bench/paired.sh "$NINE" "dflt=--load-format dummy"
  touch "$S/all.done"
  log "all done"
  ;;
fiftyfourth1_queue0)   # ~850 s: launch with `wait 520` in the staging's last call, then `wait 540` at once
  job paired_frozen 0 1100 env COMPARE="dflt:raw:short:16,64 nofreeze:dflt:short:64 dflt:async:short:64" PAIRS=2000 \
      TIME_LIMIT=20 PORT0=9500 "BENCH_ARGS=--blocks 16 --block-seconds 5" bash bench/paired.sh "$NINE" \
      "dflt=--load-format dummy" "nofreeze=--load-format dummy --gc-freeze off" \
      "async=--load-format dummy --async-scheduling on"
  touch "$S/all.done"
  log "all done"
  ;;
fiftythird2_queue0)   # ~400 s: launch with `wait 520` in the staging's last call
  job split_tiny 0 360 python3 tests/gpu/fast_paths.py --out "$S/split_tiny" --only split
  job parity_tiny 0 420 python3 tests/gpu/vllm_parity.py --out "$S/parity_tiny" --n 240 --skip-server
  touch "$S/all.done"
  log "all done"
  ;;
fiftythird1_queue0)   # ~900 s: launch with `wait 520` in the staging's last call, then `wait 540` at once
  job split_tiny 0 360 python3 tests/gpu/fast_paths.py --out "$S/split_tiny" --only split
  job paired_split 0 1000 env COMPARE="split:raw:short:16,64 off:split:short:4,16" PAIRS=2000 TIME_LIMIT=20 \
      PORT0=9490 "BENCH_ARGS=--blocks 16 --block-seconds 5" bash bench/paired.sh "$NINE" \
      "split=--load-format dummy" "off=--load-format dummy --step-graph-split 0"
  touch "$S/all.done"
  log "all done"
  ;;
fiftysecond1_queue0)   # ~450 s: launch with `wait 540` in the staging's last call
  job paired_cohorts 0 600 env COMPARE="grid:raw:short:16,64" PAIRS=2000 TIME_LIMIT=20 PORT0=9480 \
      "BENCH_ARGS=--blocks 16 --block-seconds 5" bash bench/paired.sh "$NINE" "grid=--load-format dummy"
  touch "$S/all.done"
  log "all done"
  ;;
fiftyfirst1_queue0)   # ~1,500 s by priority: launch with `wait 540` in the staging's last call, then `wait 540` at once
  # (an idle machine is handed back after ~30 s, and its jobs with it)
  job paired_async_raw 0 1000 env COMPARE="grid:async:short:16,64 async:raw:short:16,64 grid:raw:short:16,64" \
      PAIRS=2000 TIME_LIMIT=20 PORT0=9440 "BENCH_ARGS=--blocks 16 --block-seconds 5" bash bench/paired.sh "$NINE" \
      "grid=--load-format dummy" "async=--load-format dummy --async-scheduling on"
  profiled_9b profile_c64_async 9450 9b-dummy-bf16-async-profile-c64 "--load-format dummy --async-scheduling on" 64 \
      96,32 300
  job paired_fp8_c1 0 480 env COMPARE="fp8off:fp8:short fp8:fp8async:short" PAIRS=250 TIME_LIMIT=20 PORT0=9460 \
      bash bench/paired.sh "$NINE" "fp8off=--load-format dummy --quantization fp8 --gemm-row-grid off" \
      "fp8=--load-format dummy --quantization fp8" "fp8async=--load-format dummy --quantization fp8 --async-scheduling on"
  job parity_tiny_async 0 420 python3 tests/gpu/vllm_parity.py --out "$S/parity_tiny_async" --n 240 --skip-server \
      --async-scheduling
  touch "$S/all.done"
  log "all done"
  ;;
fiftieth2_queue0)   # ~750 s by priority: launch with `wait 540` in the staging's last call, then `wait 540`
  job paired_grid_warm 0 480 env COMPARE="warm:grid:short:64" PAIRS=2000 TIME_LIMIT=20 PORT0=9420 \
      "BENCH_ARGS=--blocks 24 --block-seconds 5" bash bench/paired.sh "$NINE" "grid=--load-format dummy" \
      "warm=--load-format dummy --gemm-row-grid off"
  profiled_9b profile_c64_grid 9430 9b-dummy-bf16-grid-profile-c64 "--load-format dummy" 64 96,32 300
  job parity_tiny 0 420 python3 tests/gpu/vllm_parity.py --out "$S/parity_tiny" --n 240 --skip-server
  PROFILE_PHASES=raw profiled_9b profile_raw_c64 9431 9b-dummy-bf16-raw-profile-c64 "--load-format dummy" 64 96,32 300
  touch "$S/all.done"
  log "all done"
  ;;
fiftieth1_queue0)   # ~1,100 s by priority: launch with `wait 540` in the staging's last call, then `wait 540`
  # 24 blocks of 5 s a point (the twenty-fifth session's 12 of one 200-request pool each, ~2.5 s: ~5 steps at c=64)
  job paired_grid 0 900 env COMPARE="grid:raw:short:16,64 warm:grid:short:64" PAIRS=2000 TIME_LIMIT=20 PORT0=9400 \
      "BENCH_ARGS=--blocks 24 --block-seconds 5" bash bench/paired.sh "$NINE" "grid=--load-format dummy" \
      "warm=--load-format dummy --gemm-row-grid off"
  job parity_tiny 0 420 python3 tests/gpu/vllm_parity.py --out "$S/parity_tiny" --n 240 --skip-server
  job cache_cases_tiny 0 300 python3 tests/gpu/fast_paths.py --out "$S/cache_cases_tiny" --only cache,eviction
  profiled_9b profile_c64_grid 9410 9b-dummy-bf16-grid-profile-c64 "--load-format dummy" 64 96,32 330
  touch "$S/all.done"
  log "all done"
  ;;
fortyninth2_queue0)   # ~300 s: launch with `wait 540` in the staging's last call
  job paired_thread_c1_fp8 0 420 env COMPARE="fp8:fp8thread:short" PAIRS=250 TIME_LIMIT=20 PORT0=9360 \
      bash bench/paired.sh "$NINE" "fp8=--load-format dummy --quantization fp8" \
      "fp8thread=--load-format dummy --quantization fp8 --engine-core thread"
  touch "$S/all.done"
  log "all done"
  ;;
fortyninth1_queue0)   # ~1,150 s by priority: launch with `wait 540` in the staging's last call, then `wait 540`
  job cache_cases_tiny 0 300 python3 tests/gpu/fast_paths.py --out "$S/cache_cases_tiny" --only cache,eviction
  job paired_cache_c1_fp8 0 360 env COMPARE="off:on:short" PAIRS=250 TIME_LIMIT=20 PORT0=9350 \
      bash bench/paired.sh "$NINE" "off=--load-format dummy --quantization fp8 --state-cache off" \
      "on=--load-format dummy --quantization fp8"
  profiled_9b profile_fp8_stack_on 9380 9b-dummy-fp8-stack-cache-on-c1 "--load-format dummy --quantization fp8" 1 \
      8,2,stack 240
  job parity_tiny 0 420 python3 tests/gpu/vllm_parity.py --out "$S/parity_tiny" --n 240 --skip-server
  job fast_paths_memo 0 300 python3 tests/gpu/fast_paths.py --out "$S/fast_paths_memo" --only memo --scope step
  touch "$S/all.done"
  log "all done"
  ;;
fortyeighth2_queue0)   # ~800 s by priority: launch with `wait 540` in the staging's last call, then `wait 540`
  job server_dp2_1gpu 0 480 python3 tests/gpu/vllm_parity.py --out "$S/server_dp2_1gpu" --skip-parity --dp 2 \
      --engines-per-gpu 2
  # where the state cache's 0.45 ms on one short FP8 decision goes: the steps' Python calls, cache on, then off
  profiled_9b profile_fp8_stack_on 9380 9b-dummy-fp8-stack-cache-on-c1 "--load-format dummy --quantization fp8" 1 \
      8,2,stack 240
  profiled_9b profile_fp8_stack_off 9381 9b-dummy-fp8-stack-cache-off-c1 \
      "--load-format dummy --quantization fp8 --state-cache off" 1 8,2,stack 240
  touch "$S/all.done"
  log "all done"
  ;;
fortyeighth1_queue0)   # ~1,300 s in all, by priority: launch with `wait 540` in the staging's last call
  # issue 13's DP=2 target on one GPU: two engines (state affinity routes each state's requests to one), then one;
  # the 32-state point at c=16 is the affinity case (three requests a state: seen, cached, hit)
  local_shared=(WORKLOADS=shared-state CONC=16 CONC_OVERRIDES= TIME_LIMIT=15 WARMUP=4 READY_TIMEOUT=420
                BENCH_TIMEOUT=300 "BENCH_ARGS=--shared-states 4096x64,4096x96x32" PHASES=server)
  job shared_dp2_1gpu 0 560 env "${local_shared[@]}" LABEL=9b-dummy-bf16-cache-dp2-1gpu \
      SERVER_ARGS="--load-format dummy --dp 2 --engines-per-gpu 2" bash bench/gpu_bench.sh "$NINE" 8741
  job shared_dp1 0 360 env "${local_shared[@]}" LABEL=9b-dummy-bf16-cache-dp1 \
      SERVER_ARGS="--load-format dummy" bash bench/gpu_bench.sh "$NINE" 8742
  # issue 12's c=16/64 target with two engines on the GPU: raw vLLM in clef-bench's process, in time blocks
  job paired_two_raw 0 600 env COMPARE="two:raw:short:16,64" PAIRS=200 TIME_LIMIT=15 PORT0=9370 GPU_SHARE=0.3 \
      bash bench/paired.sh "$NINE" "two=--load-format dummy --dp 2 --engines-per-gpu 2"
  touch "$S/all.done"
  log "all done"
  ;;
fortyseventh2_queue0)   # ~450 s in all, by priority: launch with `wait 540` in the staging's last call
  # what the cache (the default) costs one short FP8 decision at c=1
  job paired_cache_c1_fp8 0 330 env COMPARE="off:on:short" PAIRS=250 TIME_LIMIT=20 PORT0=9350 \
      bash bench/paired.sh "$NINE" "off=--load-format dummy --quantization fp8 --state-cache off" \
      "on=--load-format dummy --quantization fp8"
  job paired_cache_fp8 0 300 env COMPARE="bf16:fp8:shared-state" PAIRS=100 TIME_LIMIT=20 PORT0=9340 \
      "BENCH_ARGS=--shared-states 15872x17" bash bench/paired.sh "$NINE" \
      "bf16=--load-format dummy" "fp8=--load-format dummy --quantization fp8"
  touch "$S/all.done"
  log "all done"
  ;;
fortythird1_queue0)   # ~2,400 s in all, by priority (the last jobs may be cut): launch with `wait 540` in the
  # staging's last call, then `wait 540` until "all done"
  # --nvfp4-kernel bf16: the tiny Hybrid's answers against Marlin's, then the 9B Hybrid served both ways, paired
  # (short c=1, c=16/64 in time blocks), then in process with it (its GPU profile beside Marlin's)
  job nvfp4_tiny 0 480 python3 tests/gpu/fast_paths.py --out "$S/nvfp4_tiny" --only nvfp4 --n 24
  job paired_hybrid_nvfp4 0 600 env COMPARE="marlin:bf16:short marlin:bf16:short:16,64" PAIRS=200 TIME_LIMIT=20 \
      PORT0=9280 bash bench/paired.sh "$HYBRID" "marlin=--load-format clef-dummy" \
      "bf16=--load-format clef-dummy --nvfp4-kernel bf16"
  mkdir -p "$S/latency_hybrid_bf16"
  job latency_hybrid_bf16 0 330 python3 bench/latency.py --modes step --ckpt "$HYBRID" --nvfp4-kernel bf16 \
      --out "$S/latency_hybrid_bf16/latency.json"
  # the 64-record head graphs against the default 16 at c=16/64, then the default against raw vLLM in turns
  # (raw vLLM's engine in clef-bench's process, --versus-raw): issue 12's ratios from the same minutes
  job paired_bf16_raw 0 700 env COMPARE="bf16:bf16r64:short:16,64 bf16:raw:short:1,16,64" PAIRS=200 \
      TIME_LIMIT=20 PORT0=9250 bash bench/paired.sh "$NINE" "bf16=--load-format dummy" \
      "bf16r64=--load-format dummy --head-graph-records 64"
  mkdir -p "$S/sweep_fp8"
  job sweep_fp8 0 330 python3 bench/latency.py --modes step --quantization fp8 --sweep 368:528:16 --ckpt "$NINE" \
      --out "$S/sweep_fp8/latency.json"
  planned_pair_fp8
  job cache_cases_tiny 0 300 python3 tests/gpu/fast_paths.py --out "$S/cache_cases_tiny" --only cache,eviction
  profiled_9b profile_c64 9230 9b-dummy-bf16-defaults-profile-c64 "--load-format dummy" 64 96,32 330
  PROFILE_PHASES=raw profiled_9b profile_raw_c64 9231 9b-dummy-bf16-raw-profile-c64 "--load-format dummy" 64 96,32 300
  touch "$S/all.done"
  log "all done"
  ;;
fortysecond1_queue0)   # ~1,350 s: launch with `wait 540` in the staging's last call, then `wait 540` twice
  mkdir -p "$S/sweep_hybrid" "$S/sweep_bf16"
  job sweep_hybrid 0 540 python3 bench/latency.py --modes step --sweep 256:1024:16 --ckpt "$HYBRID" \
      --out "$S/sweep_hybrid/latency.json"
  job sweep_bf16 0 480 python3 bench/latency.py --modes step --sweep 256:1024:16 --ckpt "$NINE" \
      --out "$S/sweep_bf16/latency.json"
  # the state cache's FP8 follow-ups with the step scope (44.0-44.8 ms before it; the 40 ms target), c=1
  traced_9b followups_9b_fp8 400 8793 9b-dummy-fp8-cache-on-step-c1 1 \
      SERVER_ARGS="--load-format dummy --quantization fp8 --state-cache on"
  job paired_batch_wait_low_bf16 0 420 env COMPARE="bf16:bf16nowait:short:4,8" PAIRS=200 TIME_LIMIT=20 PORT0=9260 \
      bash bench/paired.sh "$NINE" "bf16=--load-format dummy" "bf16nowait=--load-format dummy --batch-wait-ms 0"
  touch "$S/all.done"
  log "all done"
  ;;
fortyfirst1_queue0)   # ~1,400 s: launch with `wait 540` in the staging's last call, then `wait 540` twice
  job parity_tiny 0 330 python3 tests/gpu/vllm_parity.py --out "$S/parity_tiny" --n 240 --skip-server
  job paired_defaults_fp8 0 360 env COMPARE="fp8:fp8before:short" PAIRS=200 TIME_LIMIT=20 PORT0=9210 \
      bash bench/paired.sh "$NINE" "fp8=--load-format dummy --quantization fp8" \
      "fp8before=--load-format dummy --quantization fp8 --idle-cleanup-step on --prefill-graph-buckets 64,128,192,256,320,384,448,512,640,768,1024,1280,1536,2048,3072,4096"
  # the release's own layout: its start-up lines (kernels, Marlin W4A16), one decision and c=16/64 beside raw vLLM
  job short_9b_hybrid 0 480 env "${SHORT[@]}" LABEL=9b-dummy-hybrid-short SERVER_ARGS="--load-format clef-dummy" \
      bash bench/gpu_bench.sh "$HYBRID" 9240
  # the c=64 gap: steps, GPU busy and idle per step, the server's and raw vLLM's (decisions 96-127)
  profiled_9b profile_c64 9230 9b-dummy-bf16-defaults-profile-c64 "--load-format dummy" 64 96,32 330
  PROFILE_PHASES=raw profiled_9b profile_raw_c64 9231 9b-dummy-bf16-raw-profile-c64 "--load-format dummy" 64 96,32 300
  touch "$S/all.done"
  log "all done"
  ;;
fortieth1_queue0)   # ~560 s: launch with `wait 540` in the staging's last call, then `wait 540`
  # issue 12's targets with the new defaults: one decision (BF16 and FP8) and short c=16/64 against raw vLLM
  job short_9b_bf16_defaults 0 420 env "${SHORT[@]}" LABEL=9b-dummy-bf16-defaults40-short \
      SERVER_ARGS="--load-format dummy" bash bench/gpu_bench.sh "$NINE" 9201
  job short_9b_fp8_defaults 0 360 env "${SHORT[@]}" CONC=1 LABEL=9b-dummy-fp8-defaults40-c1 \
      SERVER_ARGS="--load-format dummy --quantization fp8" RAW_ARGS="--raw-quantization fp8" bash bench/gpu_bench.sh "$NINE" 9202
  touch "$S/all.done"
  log "all done"
  ;;
thirtyninth1_queue0)   # ~1,600 s: launch with `wait 540` in the staging's last call, then `wait 540` twice
  # what the empty step after the last finished request costs: the default (rule 4: no such step) against
  # --idle-cleanup-step on (vLLM's step), FP8, short c=1; then the default traced (engine_done -> engine_sent)
  job paired_cleanup_fp8 0 360 env COMPARE="fp8:fp8cleanup:short" PAIRS=200 TIME_LIMIT=20 PORT0=9170 \
      bash bench/paired.sh "$NINE" "fp8=--load-format dummy --quantization fp8" \
      "fp8cleanup=--load-format dummy --quantization fp8 --idle-cleanup-step on"
  # the scheduler's rule 5: an idle engine holds a few new requests up to 2 ms to batch them (BF16, short,
  # c=16/64 in time blocks: where the server reaches 90.5 / 92.8 % of raw vLLM)
  job paired_batch_wait_bf16 0 420 env COMPARE="bf16:bf16wait:short:16,64" PAIRS=200 TIME_LIMIT=20 PORT0=9190 \
      bash bench/paired.sh "$NINE" "bf16=--load-format dummy" "bf16wait=--load-format dummy --batch-wait-ms 2"
  # buckets where the GEMMs are cheap (bench/bucket_plan.py on the GEMM sweeps): BF16 pads ~397 tokens to 400
  # instead of 448 (modelled -1.8 ms a step), FP8 to 464 instead of 448 (modelled -0.2 ms)
  job paired_buckets_bf16 0 360 env COMPARE="bf16:bf16b400:short" PAIRS=200 TIME_LIMIT=20 PORT0=9180 \
      bash bench/paired.sh "$NINE" "bf16=--load-format dummy" \
      "bf16b400=--load-format dummy --prefill-graph-buckets 64,128,192,256,320,384,400,448,512,640,768,1024,1280,1536,2048,3072,4096"
  job paired_buckets_fp8 0 360 env COMPARE="fp8:fp8b464:short" PAIRS=200 TIME_LIMIT=20 PORT0=9185 \
      bash bench/paired.sh "$NINE" "fp8=--load-format dummy --quantization fp8" \
      "fp8b464=--load-format dummy --quantization fp8 --prefill-graph-buckets 64,128,192,256,320,384,464,512,640,768,1024,1280,1536,2048,3072,4096"
  traced_9b trace_fp8_nocleanup 200 9175 9b-dummy-fp8-trace-nocleanup-c1 1 WORKLOADS=short "BENCH_ARGS=" \
      TIME_LIMIT=10 "SERVER_ARGS=--load-format dummy --quantization fp8"
  touch "$S/all.done"
  log "all done"
  ;;
thirtyeighth2_queue0)   # ~560 s: launch with `wait 540` in the staging's last call, then `wait` for the rest
  # the memo's repeats compared between two replays (thirtyeighth1 compared a capturing run with a replay)
  job fast_paths_memo2 0 300 python3 tests/gpu/fast_paths.py --out "$S/fast_paths_memo2" --only memo --scope step
  # what the memo saves: the default FP8 server against the same with --gdn-metadata-memo off, short c=1
  job paired_memo_fp8 0 360 env COMPARE="fp8:fp8nomemo:short" PAIRS=200 TIME_LIMIT=20 PORT0=9160 \
      bash bench/paired.sh "$NINE" "fp8=--load-format dummy --quantization fp8" \
      "fp8nomemo=--load-format dummy --quantization fp8 --gdn-metadata-memo off"
  touch "$S/all.done"
  log "all done"
  ;;
thirtyseventh2_queue0)   # ~600 s: launch with `wait 540` in the staging's last call, then `wait` for the rest
  # vLLM's input preparation (3.85 ms of a short FP8 step in thirtyseventh1) split at the model runner's methods, and
  # where its Python time goes (py-spy on the engine core, without stopping it)
  traced_9b trace_fp8_runner 330 9131 9b-dummy-fp8-trace-runner-c1 1 WORKLOADS=short "BENCH_ARGS=" TIME_LIMIT=10 \
      "SERVER_ARGS=--load-format dummy --quantization fp8" PYSPY=1000,9 "PYSPY_BIN=${PYSPY_BIN:-py-spy}"
  # the engine core in a thread with BF16 (FP8 gained 0.919x at c=1 in thirtyseventh1)
  job paired_engine_thread_bf16 0 420 env COMPARE="bf16:bf16thread:short" PAIRS=200 TIME_LIMIT=20 PORT0=9120 \
      bash bench/paired.sh "$NINE" "bf16=--load-format dummy" "bf16thread=--load-format dummy --engine-core thread"
  touch "$S/all.done"
  log "all done"
  ;;
thirtyseventh1_queue0)   # ~1,500 s: launch with `wait 520` in the staging's last call, then `wait 540`, then the rest
  # the GDN bodies without their mask multiplies (padded gate inputs -inf): the step graphs against vLLM's path,
  # one request at a time (tiny; expect bit-identical rows as before)
  job fast_paths_step_gates 0 300 python3 tests/gpu/fast_paths.py --out "$S/fast_paths_step_gates" --n 60 \
      --only graphs --scope step
  # the engine core in a thread of the server's process (--engine-core thread) against its own process (the
  # default), FP8: one decision at c=1 (in process 18.1 vs 20.7 ms apart in the eleventh session, before the step
  # graphs), then short c=16/64 (both share one interpreter lock in thread mode)
  job paired_engine_thread_fp8 0 480 env COMPARE="fp8:fp8thread:short fp8:fp8thread:short:16,64" PAIRS=200 \
      TIME_LIMIT=20 PORT0=9110 bash bench/paired.sh "$NINE" "fp8=--load-format dummy --quantization fp8" \
      "fp8thread=--load-format dummy --quantization fp8 --engine-core thread"
  # one short decision's engine time split without a profiler (the worker's step events, clef_vllm.util.trace): the
  # default FP8 server, then the default BF16 server with the state cache on (short, then 4k / 16k follow-ups)
  traced_9b trace_fp8_steps 300 9101 9b-dummy-fp8-trace-steps-c1 1 WORKLOADS=short "BENCH_ARGS=" \
      "SERVER_ARGS=--load-format dummy --quantization fp8"
  traced_9b trace_bf16_cache_steps 360 9102 9b-dummy-bf16-cache-on-trace-steps-c1 1
  # the FP8 step's kernels after the mask change (48 fewer element-wise kernels expected)
  profiled_9b profile_fp8_gates_c1 9103 9b-dummy-fp8-gates-profile-c1 "--load-format dummy --quantization fp8" 1 8,5 240
  touch "$S/all.done"
  log "all done"
  ;;
thirtysixth2_queue0)   # ~300 s, after thirtyfifth1 (whose c=64 half of paired_eager_batches ran out of time): --eager-batches at c=64
  job paired_eager_batches_c64 0 330 env COMPARE="graphs:eager:short:64" PAIRS=200 TIME_LIMIT=20 PORT0=9080 \
      bash bench/paired.sh "$NINE" "graphs=--load-format dummy" "eager=--load-format dummy --eager-batches on"
  touch "$S/all.done"
  log "all done"
  ;;
thirtysixth1_queue0)   # ~650 s, after thirtyfifth1 on the same machine: where a single FP8 decision's time goes (profiled at
  # c=1), then the state cache with FP8 next to BF16 on one 16k state
  profiled_9b profile_fp8_c1 9002 9b-dummy-fp8-default-profile-c1 "--load-format dummy --quantization fp8" 1 8,5 300
  job paired_cache_fp8 0 330 env COMPARE="bf16:fp8:shared-state" PAIRS=100 TIME_LIMIT=20 PORT0=9010 \
      "BENCH_ARGS=--shared-states 15872x17" bash bench/paired.sh "$NINE" \
      "bf16=--load-format dummy --state-cache on" "fp8=--load-format dummy --state-cache on --quantization fp8"
  touch "$S/all.done"
  log "all done"
  ;;
thirtyfifth1_queue0)   # ~1,550 s: launch with `wait 520` in the staging's last call, then `wait 540`, then the rest; the most wanted answers first
  fine=64,128,192,256,288,320,352,384,416,448,480,512,640,768,1024,1280,1536,2048,3072,4096
  job paired_eager_batches 0 360 env COMPARE="graphs:eager:short:16,64" PAIRS=200 TIME_LIMIT=20 PORT0=9040 \
      bash bench/paired.sh "$NINE" "graphs=--load-format dummy" "eager=--load-format dummy --eager-batches on"
  # and the small bodies' CPU work on the event loop (the default since this plan) against the thread pool
  job paired_fine_buckets_fp8 0 420 env COMPARE="fp8:fp8fine:short fp8pool:fp8:short" PAIRS=200 TIME_LIMIT=20 \
      PORT0=9070 bash bench/paired.sh "$NINE" "fp8=--load-format dummy --quantization fp8" \
      "fp8fine=--load-format dummy --quantization fp8 --prefill-graph-buckets $fine" \
      "fp8pool=--load-format dummy --quantization fp8 --cpu-inline-bytes 0"
  job short_9b_bf16_eager_512 0 480 env "${SHORT[@]}" CONC=16,64 TIME_LIMIT=30 BENCH_TIMEOUT=240 \
      "BENCH_ARGS=--num-requests 512" LABEL=9b-dummy-bf16-eager-batches-short-512 \
      SERVER_ARGS="--load-format dummy --eager-batches on" bash bench/gpu_bench.sh "$NINE" 9051
  job gemm_sizes 0 120 python3 bench/gemm_sizes.py --config "$NINE/config.json" --tokens 256:1024:16 \
      --out "$S/gemm_sizes/gemm_sizes_bf16.json"
  job gemm_sizes_fp8 0 120 python3 bench/gemm_sizes.py --config "$NINE/config.json" --tokens 256:1024:16 --fp8 \
      --out "$S/gemm_sizes_fp8/gemm_sizes_fp8.json"
  job paired_fine_buckets 0 330 env COMPARE="default:fine:short" PAIRS=200 TIME_LIMIT=20 PORT0=9060 \
      bash bench/paired.sh "$NINE" "default=--load-format dummy" "fine=--load-format dummy --prefill-graph-buckets $fine"
  touch "$S/all.done"
  log "all done"
  ;;
thirtyfourth1_queue0)   # ~1,150 s: launch with `wait 520` in the staging's last call, then `wait 540`, then what is left
  job paired_async 0 420 env COMPARE="sync:async:short sync:async:short:16,64" PAIRS=200 TIME_LIMIT=20 PORT0=9020 \
      bash bench/paired.sh "$NINE" "sync=--load-format dummy" "async=--load-format dummy --async-scheduling on"
  job short_9b_bf16_async_512 0 480 env "${SHORT[@]}" CONC=16,64 TIME_LIMIT=30 BENCH_TIMEOUT=240 \
      "BENCH_ARGS=--num-requests 512" LABEL=9b-dummy-bf16-async-short-512 \
      SERVER_ARGS="--load-format dummy --async-scheduling on" bash bench/gpu_bench.sh "$NINE" 9031
  job parity_tiny_async 0 330 python3 tests/gpu/vllm_parity.py --out "$S/parity_tiny_async" --n 240 --skip-server \
      --async-scheduling
  profiled_9b profile_async_c16 9032 9b-dummy-bf16-async-profile-c16 "--load-format dummy --async-scheduling on" 16 \
      24,32 300
  PROFILE_PHASES=raw profiled_9b profile_raw_c16 9033 9b-dummy-bf16-raw-profile-c16 "--load-format dummy" 16 24,32 300
  touch "$S/all.done"
  log "all done"
  ;;
thirtysecond1_queue0)   # ~300 s: launch with `wait 380` in the staging's last call (the first 9B server compiles)
  # (a window's decisions must fit the run's: clef-bench sends 4 + 64 at c=16 and 4 + 256 at c=64; the first run
  # asked c=16 for 24..71 and, before the backend stopped an open window at shutdown, got no trace)
  profiled_9b profile_c16 8991 9b-dummy-bf16-default-profile-c16 "--load-format dummy" 16 24,32 330
  profiled_9b profile_c64 8992 9b-dummy-bf16-default-profile-c64 "--load-format dummy" 64 80,128
  touch "$S/all.done"
  log "all done"
  ;;
thirtyfirst1_queue0)   # ~1,750 s: launch with `wait 520` in a 600 s call, then `wait 540` twice (the last jobs may not fit)
  # the defaults (step scope, GDN metadata built once per step) against the float32 reference
  job parity_tiny 0 330 python3 tests/gpu/vllm_parity.py --out "$S/parity_tiny" --n 240 --skip-server
  # the default server next to raw vLLM: issue 12's single-decision and c=16/64 targets
  job short_9b_bf16_step 0 420 env "${SHORT[@]}" LABEL=9b-dummy-bf16-step-short SERVER_ARGS="--load-format dummy" \
      bash bench/gpu_bench.sh "$NINE" 8951
  job short_9b_fp8_step 0 360 env "${SHORT[@]}" CONC=1 LABEL=9b-dummy-fp8-step-c1 \
      SERVER_ARGS="--load-format dummy --quantization fp8" RAW_ARGS="--raw-quantization fp8" bash bench/gpu_bench.sh "$NINE" 8952
  # issue 13's follow-ups on cached 4k/16k states, step vs core, both --state-cache on (each pool its own size now)
  job paired_step_cache 0 300 env COMPARE="cache:stepcache:shared-state" PAIRS=200 TIME_LIMIT=30 PORT0=8960 \
      "BENCH_ARGS=--shared-states 4096x32,15872x17" bash bench/paired.sh "$NINE" \
      "cache=--load-format dummy --state-cache on --prefill-graph-scope core" \
      "stepcache=--load-format dummy --state-cache on"
  # when each step launches its graphs now (bench/step_timeline.py; the fifteenth session's: 8.0-12.2 ms profiled)
  profiled_9b profile_default 8981 9b-dummy-bf16-default-profile-c1 "--load-format dummy"
  # the step graphs against vLLM's path after the padded-row fix (one request at a time, chunked)
  job fast_paths_step 0 240 python3 tests/gpu/fast_paths.py --out "$S/fast_paths_step" --n 60 --only graphs --scope step
  # issue 13's cost of the cache on unique short requests, the cache-on server's pool its own (thirteenth: one block)
  job paired_off_on 0 300 env COMPARE="off:on:short" PAIRS=300 TIME_LIMIT=20 PORT0=8970 bash bench/paired.sh "$NINE" \
      "off=--load-format dummy" "on=--load-format dummy --state-cache on"
  touch "$S/all.done"
  log "all done"
  ;;
thirtieth1_queue0)   # ~560 s: launch with `wait 540` in the staging's last call (all the budget a second round has)
  job parity_tiny_step 0 330 python3 tests/gpu/vllm_parity.py --out "$S/parity_tiny_step" --n 240 --skip-server \
      --prefill-graph-scope step
  job paired_step_cache 0 300 env COMPARE="cache:stepcache:shared-state" PAIRS=100 TIME_LIMIT=20 PORT0=8930 \
      "BENCH_ARGS=--shared-states 4096x32,15872x17" bash bench/paired.sh "$NINE" \
      "cache=--load-format dummy --state-cache on" \
      "stepcache=--load-format dummy --state-cache on --prefill-graph-scope step"
  touch "$S/all.done"
  log "all done"
  ;;
twentyninth1_queue0)   # ~1,600 s: launch with `wait 520` in a 600 s call, then `wait 540` twice (the 9B compiles in paired_step)
  job parity_tiny_step 0 330 python3 tests/gpu/vllm_parity.py --out "$S/parity_tiny_step" --n 240 --skip-server \
      --prefill-graph-scope step
  job cache_cases_step 0 300 python3 tests/gpu/fast_paths.py --out "$S/cache_cases_step" --only cache,eviction \
      --scope step
  job paired_step 0 420 env COMPARE="core:step:short core:step:short:16" PAIRS=300 TIME_LIMIT=20 PORT0=8920 \
      bash bench/paired.sh "$NINE" "core=--load-format dummy" "step=--load-format dummy --prefill-graph-scope step"
  # issue 13's follow-ups on a cached state (4k, 16k) with the step scope, both servers --state-cache on
  job paired_step_cache 0 300 env COMPARE="cache:stepcache:shared-state" PAIRS=200 TIME_LIMIT=30 PORT0=8930 \
      "BENCH_ARGS=--shared-states 4096x32,15872x17" bash bench/paired.sh "$NINE" \
      "cache=--load-format dummy --state-cache on" \
      "stepcache=--load-format dummy --state-cache on --prefill-graph-scope step"
  profiled_9b profile_step 8895 9b-dummy-bf16-step-profile-c1 "--load-format dummy --prefill-graph-scope step"
  # issue 12's "where the time goes" table, core vs step, profiler-backed, in process
  job latency_step 0 300 python3 bench/latency.py --modes graphs,step --ckpt "$NINE" \
      --out "$S/latency_step/latency.json"
  # does FA3's longest sequence (the model's, in the step graphs) cost the ~1 ms direct replays saved?
  job step_graph_probe 0 260 python3 bench/step_graph_probe.py --out "$S/step_graph_probe"
  touch "$S/all.done"
  log "all done"
  ;;
twentyeighth1_queue0)   # ~1,050 s: launch with `wait 520` in a 600 s call, then `wait 540`
  job step_graph_probe 0 300 python3 bench/step_graph_probe.py --out "$S/step_graph_probe"
  job fast_paths_step 0 240 python3 tests/gpu/fast_paths.py --out "$S/fast_paths_step" --n 60 --only graphs --scope step
  job paired_step 0 480 env COMPARE="core:step:short,long core:step:short:16,64" PAIRS=300 TIME_LIMIT=20 \
      "BENCH_ARGS=--long-tokens 4096" bash bench/paired.sh "$NINE" "core=--load-format dummy" \
      "step=--load-format dummy --prefill-graph-scope step"
  job paired_step_fp8 0 300 env COMPARE="fp8core:fp8step:short" PAIRS=200 TIME_LIMIT=20 PORT0=8910 \
      bash bench/paired.sh "$NINE" "fp8core=--load-format dummy --quantization fp8" \
      "fp8step=--load-format dummy --quantization fp8 --prefill-graph-scope step"
  touch "$S/all.done"
  log "all done"
  ;;
twentyseventh1_queue0)   # ~1,000 s: launch with `wait 520` in a 600 s call, then `wait 540`
  job paired_step 0 720 env COMPARE="core:step:short,long core:step:short:16,64 fp8core:fp8step:short" \
      PAIRS=300 TIME_LIMIT=20 GPU_SHARE=0.22 "BENCH_ARGS=--long-tokens 4096" bash bench/paired.sh "$NINE" \
      "core=--load-format dummy" "step=--load-format dummy --prefill-graph-scope step" \
      "fp8core=--load-format dummy --quantization fp8" "fp8step=--load-format dummy --quantization fp8 --prefill-graph-scope step"
  job paired_layer 0 420 env COMPARE="core:layer:short,long" PAIRS=300 TIME_LIMIT=20 PORT0=8910 \
      "BENCH_ARGS=--long-tokens 4096" bash bench/paired.sh "$NINE" "core=--load-format dummy" \
      "layer=--load-format dummy --prefill-graph-scope layer"
  touch "$S/all.done"
  log "all done"
  ;;
twentyfifth1_queue0)   # thirteenth session, round 3 (~400 s): the c=1 comparisons, each side sampling the same minutes
  job paired 0 560 env COMPARE="off:on:short,long off:fp8:short" PAIRS=300 TIME_LIMIT=20 "BENCH_ARGS=--long-tokens 4096" \
      bash bench/paired.sh "$NINE" "off=--load-format dummy --state-cache off" "on=--load-format dummy --state-cache on" \
      "fp8=--load-format dummy --quantization fp8"
  touch "$S/all.done"
  log "all done"
  ;;
twentyfourth1_queue0)   # thirteenth session: the CPU's share of the spread at c=1 (~300 s)
  job host_speed 0 120 python3 bench/host_speed.py --out "$S/host_speed/host_speed.json"
  picks=$(python3 -c "
import json, sys
rows = sorted(json.load(open(sys.argv[1]))['per_cpu'], key=lambda r: r['launch_us'])
print(','.join(str(r['cpu']) for r in rows[:8]), ','.join(str(r['cpu']) for r in rows[-8:]))" \
      "$S/host_speed/host_speed.json" 2>/dev/null || echo "0-7 8-15")
  log "fastest and slowest CPUs: $picks"
  # shellcheck disable=SC2086
  job placement 0 420 bash bench/placement.sh "$NINE" $picks 3 8895
  touch "$S/all.done"
  log "all done"
  ;;
twentyfirst_queue0)    # two GPUs: issue 13's DP=2 hits with unit matching (state affinity), then short DP=2 vs raw
  cache_on_9b_dp2
  job short_9b_bf16_dp2 0,1 420 env "${SHORT[@]}" LABEL=9b-dummy-bf16-dp2-default16 \
      SERVER_ARGS="--load-format dummy --data-parallel-size 2" RAW_ARGS="--raw-engine-arg data_parallel_size=2" \
      bash bench/gpu_bench.sh "$NINE" 8876
  touch "$S/all.done"
  log "all done"
  ;;
twentieth1_queue0)   # the new defaults (head graphs for up to 16 requests a step, every record bucket checked in
                     # the warm-up): the tiny server (its first several-request step held it 0.5 s), then 9B vs raw
  job short_tiny 0 200 env "${SHORT[@]}" CONC=16,64 PHASES=server LABEL=tiny-headgraphs-default16-short \
      bash bench/gpu_bench.sh "$TINY" 8861
  job short_9b_bf16 0 400 env "${SHORT[@]}" LABEL=9b-dummy-bf16-headgraphs-default16-short \
      SERVER_ARGS="--load-format dummy" bash bench/gpu_bench.sh "$NINE" 8862
  touch "$S/all.done"
  log "all done"
  ;;
sixteenth1_queue0)
  job head_graphs 0 240 python3 tests/gpu/head_graphs.py --out "$S/head_graphs" --n 200
  job latency_headgraphs 0 420 python3 bench/latency.py --modes graphs,eagerhead --ckpt "$NINE" \
      --out "$S/latency_headgraphs/latency.json"
  job short_9b_bf16 0 420 env "${SHORT[@]}" LABEL=9b-dummy-bf16-headgraphs-short SERVER_ARGS="--load-format dummy" \
      bash bench/gpu_bench.sh "$NINE" 8821
  job latency_headgraphs_fp8 0 300 python3 bench/latency.py --modes graphs --quantization fp8 --ckpt "$NINE" \
      --out "$S/latency_headgraphs_fp8/latency.json"
  touch "$S/all.done"
  log "all done"
  ;;
fourteenth1_queue0)
  job latency_phases 0 300 python3 bench/latency.py --modes graphs --ckpt "$NINE" --out "$S/latency_phases/latency.json"
  job latency_phases_fp8 0 300 python3 bench/latency.py --modes graphs --quantization fp8 --ckpt "$NINE" \
      --out "$S/latency_phases_fp8/latency.json"
  touch "$S/all.done"
  log "all done"
  ;;
thirteenth1_queue0)
  traced_9b followups_9b_bf16 400 8791 9b-dummy-bf16-cache-on-keyhash-c1 1
  job latency_graphs 0 300 python3 bench/latency.py --modes graphs --ckpt "$NINE" --out "$S/latency_graphs/latency.json"
  job latency_graphs_fp8 0 300 python3 bench/latency.py --modes graphs --quantization fp8 --ckpt "$NINE" \
      --out "$S/latency_graphs_fp8/latency.json"
  job short_9b_fp8 0 400 env "${SHORT[@]}" CONC=1 LABEL=9b-dummy-fp8-c1 SERVER_ARGS="--load-format dummy --quantization fp8" \
      RAW_ARGS="--raw-quantization fp8" bash bench/gpu_bench.sh "$NINE" 8792
  touch "$S/all.done"
  log "all done"
  ;;
twelfth1_queue0)
  cache_gpu_cases_tiny
  traced_9b trace_shared_9b_bf16 500 8781 9b-dummy-bf16-cache-on-keyhash 1,16,64 CONC_OVERRIDES=short=1
  job latency_graphs 0 300 python3 bench/latency.py --modes graphs --ckpt "$NINE" --out "$S/latency_graphs/latency.json"
  cache_parity_tiny
  touch "$S/all.done"
  log "all done"
  ;;
eleventh1_queue0)
  traced_9b trace_9b_bf16 420 8771 9b-dummy-bf16-cache-on-trace 1 TIME_LIMIT=5 BENCH_TIMEOUT=150
  grep -n "serving on\|JIT compilation" "$S/trace_9b_bf16/server.log" >"$S/trace_9b_bf16/jit_check.txt" 2>&1
  job short_9b_bf16 0 420 env "${SHORT[@]}" LABEL=9b-dummy-bf16-rendered SERVER_ARGS="--load-format dummy" \
      bash bench/gpu_bench.sh "$NINE" 8772
  job latency_graphs 0 300 python3 bench/latency.py --modes graphs --ckpt "$NINE" --out "$S/latency_graphs/latency.json"
  touch "$S/all.done"
  log "all done"
  ;;
ninth1_queue0)
  job latency_bursts 0 560 python3 bench/latency.py --modes cache,cacheblock --followups-only --ckpt "$NINE" \
      --out "$S/latency_bursts/latency.json"
  job stages_9b_bf16 0 500 env WORKLOADS=shared-state,short CONC=1,16,64 CONC_OVERRIDES= TIME_LIMIT=6 WARMUP=4 \
      READY_TIMEOUT=360 BENCH_TIMEOUT=300 "BENCH_ARGS=--shared-states 4096x64,15872x33" PHASES=server \
      LABEL=9b-dummy-bf16-cache-on-stages SERVER_ARGS="--load-format dummy --state-cache on" \
      bash bench/gpu_bench.sh "$NINE" 8751
  touch "$S/all.done"
  log "all done"
  ;;
launch)
  rm -f "$S"/*.done "$S"/phase_a.*
  python3 bench/make_ckpt.py tiny "$TINY" && python3 bench/make_ckpt.py 9b "$NINE" &&
      python3 bench/make_ckpt.py 9b "$HYBRID" --hybrid 17 || exit 1
  for q in queue0 queue1; do
    PLAN=$PLAN setsid nohup bash "$0" "$q" >"$S/$q.log" 2>&1 </dev/null &
  done
  log "launched queue0 and queue1"
  ;;
queue0)
  (( full )) && job parity_tiny 0 420 python3 tests/gpu/vllm_parity.py --out "$S/parity_tiny" --n 240 --skip-server
  job bench_9b_bf16 0 600 env "${NINE_SWEEP[@]}" LABEL=9b-dummy-bf16 SERVER_ARGS="--load-format dummy" \
      bash bench/gpu_bench.sh "$NINE" 8701
  (( full )) && tiny_dp1 0
  (( full )) && job engine_kill 0 420 python3 tests/gpu/engine_kill.py --out "$S/engine_kill" --port 8791
  touch "$S/queue0.done"
  while [ ! -f "$S/queue1.done" ]; do sleep 2; done
  if (( full )); then
    job server_dp2 0,1 420 python3 tests/gpu/vllm_parity.py --out "$S/server_dp2" --skip-parity --dp 2
  else
    job bench_9b_bf16_dp2 0,1 600 env "${NINE_SWEEP[@]}" LABEL=9b-dummy-bf16-dp2 \
        SERVER_ARGS="--load-format dummy --data-parallel-size 2" RAW_ARGS="--raw-engine-arg data_parallel_size=2" \
        bash bench/gpu_bench.sh "$NINE" 8705
  fi
  job bench_tiny_dp2 0,1 480 env "${TINY_SWEEP[@]}" LABEL=tiny-dp2 SERVER_ARGS="--data-parallel-size 2" \
      RAW_ARGS="--raw-engine-arg data_parallel_size=2" bash bench/gpu_bench.sh "$TINY" 8704
  touch "$S/all.done"
  log "all done"
  ;;
queue1)
  (( full )) && job quality 1 720 env TRAIN_SECONDS=100 RECORDS=300 \
      WORK=/root/clef-quality bash bench/quality_gpu.sh
  job bench_9b_fp8 1 600 env "${NINE_SWEEP[@]}" LABEL=9b-dummy-fp8 SERVER_ARGS="--load-format dummy --quantization fp8" \
      RAW_ARGS="--raw-quantization fp8" bash bench/gpu_bench.sh "$NINE" 8702
  (( full )) || tiny_dp1 1  # FP8 finishes ~1 min before BF16: the queues end closer together
  touch "$S/queue1.done"
  ;;
wait)  # wait LIMIT_S: until all jobs are done or LIMIT_S passes; then pack the results into $OUT
  limit=${2:-540}; t0=$SECONDS
  # a machine handed back between calls comes back bare: say so at once instead of waiting out the limit
  # on nothing (the twenty-second session lost 540 s of device time that way)
  if [ ! -f "$S/session.log" ]; then
    echo "no session in $S: this machine is a fresh one (the previous was handed back); launch again" >&2
    exit 3
  fi
  local_pack() {  # what has finished so far, into $OUT (a call cut short still brings back what is under $OUT)
    [ -n "${OUT:-}" ] && tar -C "$S" --exclude=ckpt --exclude='*.pt' --exclude='*.safetensors' \
        -czf "$OUT/session.tgz" . 2>/dev/null
  }
  ended=-1
  while [ ! -f "$S/all.done" ] && (( SECONDS - t0 < limit )); do
    n=$(ls "$S"/*/rc.json 2>/dev/null | wc -l)
    (( n != ended )) && { ended=$n; local_pack; }
    sleep 5
  done
  cat "$S/session.log"
  for f in "$S"/*/rc.json; do [ -f "$f" ] && cat "$f"; done
  if [ -n "${OUT:-}" ]; then
    tar -C "$S" --exclude=ckpt --exclude='*.pt' --exclude='*.safetensors' -czf "$OUT/session.tgz" . 2>/dev/null
    ls -la "$OUT"
  fi
  [ -f "$S/all.done" ] && echo "all done" || echo "still running: $(ls "$S" | grep -c . ) entries"
  ;;
*)
  echo "usage: $0 launch | wait [SECONDS]" >&2; exit 2 ;;
esac
