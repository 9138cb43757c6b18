"""The systems the serving benchmark races: plain SGLang and sglang-psa, as server flags.

Every system is `python -m sglang.launch_server` with the same common flags
(model, pytorch sampling, `--mem-fraction-static`, prefill CUDA graphs off, a
decode log line every `DECODE_LOG_INTERVAL` steps) plus its own, the attention
backend among them. Plain SGLang runs at each attention backend the H100 host
has (`PLAIN_RACE`): FA3 (SGLang's default on an H100; the offline bundle keeps
it), FlashInfer (JIT-compiles its kernels at start-up, ~100 s on a fresh
machine, all before `/health` answers) and triton (`plain`, kept for
continuity with earlier results). A stage that runs several of them compares
the sparse systems with the fastest of them in that run (analysis.py,
`fastest_plain`). sglang-psa systems name no backend: the plugin picks the
dense prefill backend and decodes on its own.

Prefill CUDA graphs are off for every system: they serve short extends, the
workloads here prefill 4K-32K-token prompts, and capturing them costs minutes.
"""

from __future__ import annotations

from dataclasses import dataclass

MEM_FRACTION_STATIC = 0.80  # same HBM budget (weights + KV pool) for every system
DECODE_LOG_INTERVAL = 10  # decode steps per "Decode batch" log line
HICACHE_HOST_GB = 16  # SGLang's hierarchical cache: host pool size
# torch.distributed's rendezvous port, beside the server's own (servers are 10 apart):
# left to SGLang, each server takes a free port and frees it before torch binds it, a
# race that servers started together lose (seen on the H200: EADDRINUSE at start-up)
NCCL_PORT_OFFSET = 5


@dataclass(frozen=True)
class System:
    name: str
    what: str
    flags: tuple[str, ...]
    plain: bool  # plain SGLang (no --sparse-mode)
    graphs: bool  # decode runs in CUDA graphs (captured up to the workload's batch)
    # `--attention-backend`; None: not passed (sglang-psa: the plugin's dense prefill
    # backend, decode on its own backend)
    attention_backend: str | None = None
    jit_s: int = 0  # extra start-up seconds compiling kernels (FlashInfer's JIT)


# Plain SGLang at each attention backend the H100 host runs, the one a stage's ratios are
# taken against being the fastest of those it ran (analysis.fastest_plain). `plain` (triton)
# comes first: it is the reference of `identical_to_plain` and of the older *_vs_plain keys.
PLAIN_RACE = ("plain", "plain_fa3", "plain_flashinfer")
# SGLang's own host tier (`--enable-hierarchical-cache`) at the backends it is measured
# with: the prefix keys compare with the faster of those a run measured.
HICACHE_RACE = ("plain_hicache", "plain_hicache_fa3")
FLASHINFER_JIT_S = 120  # FlashInfer's kernels compiled at start-up on a fresh machine


# The tiered home with a 16 GiB host tier (workload b sets its own size).
_TIERED = ("--sparse-mode", "psa", "--psa-kv-home", "tiered", "--psa-host-pool-gb", "16")

SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System(
            "plain",
            "plain SGLang, triton attention, decode CUDA graphs",
            (),
            True,
            True,
            attention_backend="triton",
        ),
        System(
            "plain_fa3",
            "plain SGLang, FA3 attention (SGLang's default on an H100), decode CUDA graphs",
            (),
            True,
            True,
            attention_backend="fa3",
        ),
        System(
            "plain_flashinfer",
            "plain SGLang, FlashInfer attention (kernels JIT-compiled at start-up), decode "
            "CUDA graphs",
            (),
            True,
            True,
            attention_backend="flashinfer",
            jit_s=FLASHINFER_JIT_S,
        ),
        System(
            "plain_fa3_p32",
            "plain SGLang, FA3 attention at --page-size 32 (sglang-psa's page size: one page "
            "a PSA block), decode CUDA graphs: what the page size alone costs plain SGLang",
            ("--page-size", "32"),
            True,
            True,
            attention_backend="fa3",
        ),
        System(
            "plain_repeat",
            "plain SGLang, triton attention, a second server: how often batched greedy "
            "decoding repeats plain's own completions (the floor of identical-to-plain)",
            (),
            True,
            True,
            attention_backend="triton",
        ),
        System(
            "plain_eager",
            "plain SGLang, triton attention, no CUDA graphs",
            ("--cuda-graph-backend-decode", "disabled"),
            True,
            False,
            attention_backend="triton",
        ),
        System(
            "plain_hicache",
            f"plain SGLang with --enable-hierarchical-cache ({HICACHE_HOST_GB} GB host pool), "
            "triton attention, decode CUDA graphs",
            ("--enable-hierarchical-cache", "--hicache-size", str(HICACHE_HOST_GB)),
            True,
            True,
            attention_backend="triton",
        ),
        System(
            "plain_hicache_fa3",
            f"plain SGLang with --enable-hierarchical-cache ({HICACHE_HOST_GB} GB host pool), "
            "FA3 attention, decode CUDA graphs",
            ("--enable-hierarchical-cache", "--hicache-size", str(HICACHE_HOST_GB)),
            True,
            True,
            attention_backend="fa3",
        ),
        System(
            "psa",
            "sglang-psa --sparse-mode psa (KV in HBM; ranked every step in the runs recorded "
            "before psa kept its selection 8 steps by default), decode CUDA graphs",
            ("--sparse-mode", "psa"),
            False,
            True,
        ),
        System(
            "psa_r1",
            "sglang-psa --sparse-mode psa --psa-rerank-interval 1 (blocks scored, ranked and "
            "read under the stop rule every step; the default keeps a selection 8 steps), "
            "decode CUDA graphs",
            ("--sparse-mode", "psa", "--psa-rerank-interval", "1"),
            False,
            True,
        ),
        System(
            "psa_certified",
            "sglang-psa --sparse-mode psa --psa-stop-rule certified (at least ε = 0.98 of "
            "every head's mass, ranked and bounded by the 5-bit key codes the pages keep) "
            "with --psa-audit-coverage 1: every step's true coverage checked by a dense "
            "pass per layer, so its speed is not the rule's; decode CUDA graphs",
            ("--sparse-mode", "psa", "--psa-stop-rule", "certified", "--psa-audit-coverage", "1"),
            False,
            True,
        ),
        System(
            "psa_certified_unaudited",
            "sglang-psa --sparse-mode psa --psa-stop-rule certified without the coverage "
            "audit: the certified rule's own speed (psa_certified's guarantee, checked "
            "there), decode CUDA graphs",
            ("--sparse-mode", "psa", "--psa-stop-rule", "certified"),
            False,
            True,
        ),
        System(
            "psa_eps1",
            "sglang-psa --sparse-mode psa --psa-threshold 1.0 (reads every block: the "
            "sparse path's overhead over plain), decode CUDA graphs",
            ("--sparse-mode", "psa", "--psa-threshold", "1.0"),
            False,
            True,
        ),
        System(
            "topk",
            "sglang-psa --sparse-mode topk (fixed 2048-token budget, KV in HBM; ranked every "
            "step in the runs recorded before the rerank interval's default became 8), decode "
            "CUDA graphs",
            ("--sparse-mode", "topk"),
            False,
            True,
        ),
        System(
            "topk_r8",
            "sglang-psa --sparse-mode topk --psa-rerank-interval 8 (the top-k selection kept "
            "8 steps; the default since it was measured here), decode CUDA graphs",
            ("--sparse-mode", "topk", "--psa-rerank-interval", "8"),
            False,
            True,
        ),
        System(
            "psa_tiered",
            "sglang-psa --sparse-mode psa --psa-kv-home tiered --psa-writeback engine (KV in "
            "HBM, every full block written back to a 16 GiB host tier by the copy engine) "
            "--disable-radix-cache, decode CUDA graphs",
            (*_TIERED, "--psa-writeback", "engine", "--disable-radix-cache"),
            False,
            True,
        ),
        System(
            "psa_tiered_uva",
            "sglang-psa --sparse-mode psa --psa-kv-home tiered --psa-writeback uva (the "
            "default: the write-back through unified addressing, no copy engine) "
            "--disable-radix-cache (no prefix caching, as the tiered home had before its "
            "prefix cache became its default), decode CUDA graphs",
            (*_TIERED, "--psa-writeback", "uva", "--disable-radix-cache"),
            False,
            True,
        ),
        System(
            "psa_tiered_prefix",
            "sglang-psa at the tiered home as it starts by default: SGLang's prefix cache "
            "over the tiered store (--radix-cache-backend psa: a shared block saved once, "
            "evicted prefixes read back from the host tier), the uva write-back, decode CUDA "
            "graphs",
            (*_TIERED, "--psa-writeback", "uva"),
            False,
            True,
        ),
        System(
            "psa_tiered_prefix_lazy",
            "psa_tiered_prefix with --psa-writeback-start 0.25: blocks are written back "
            "only once less than a quarter of the KV pool is free (until then the tiered "
            "home's KV lives in HBM alone, as the hbm home's does)",
            (
                *_TIERED,
                "--psa-writeback",
                "uva",
                "--psa-writeback-start",
                "0.25",
            ),
            False,
            True,
        ),
        System(
            "psa_tiered_prefix_recompute",
            "psa_tiered_prefix with --psa-host-prefix-min-tokens 1000000000: a prefix left "
            "only in the host tier is computed again (as plain SGLang does) instead of read "
            "from there; shared prefixes in HBM are still shared",
            (
                *_TIERED,
                "--psa-writeback",
                "uva",
                "--psa-host-prefix-min-tokens",
                "1000000000",
            ),
            False,
            True,
        ),
        System(
            "psa_tiered_prefix_ways16",
            "psa_tiered_prefix with --psa-unit-cache-ways 16: twice the unit cache's slots per "
            "set (half the sets), so fewer units read every step overflow a full set to the "
            "host tier",
            (
                *_TIERED,
                "--psa-writeback",
                "uva",
                "--psa-unit-cache-ways",
                "16",
            ),
            False,
            True,
        ),
        System(
            "psa_tiered_prefix_ws4",
            "psa_tiered_prefix with --psa-ws-window 4: admission counts the units read in "
            "the last 4 steps, what the unit cache keeps (with the layers sharing its "
            "positions, more requests' reads may fit in HBM than the 12-step window admits)",
            (
                *_TIERED,
                "--psa-writeback",
                "uva",
                "--psa-ws-window",
                "4",
            ),
            False,
            True,
        ),
        System(
            "psa_tiered_ws4",
            "psa_tiered_uva with --psa-ws-window 4: admission counts the units read in the "
            "last 4 steps, what the unit cache keeps (12 by default admitted 9 of workload "
            "b's 32 at once)",
            (*_TIERED, "--psa-writeback", "uva", "--disable-radix-cache", "--psa-ws-window", "4"),
            False,
            True,
        ),
        System(
            "psa_mr04",
            "psa with --psa-max-read-fraction 0.4: a KV head reads at most 0.4 of its "
            "request's blocks (the default is 0.5)",
            ("--sparse-mode", "psa", "--psa-max-read-fraction", "0.4"),
            False,
            True,
        ),
        System(
            "psa_tiered_mr04",
            "psa_tiered_uva with --psa-max-read-fraction 0.4 (the default is 0.5)",
            (
                *_TIERED,
                "--psa-writeback",
                "uva",
                "--disable-radix-cache",
                "--psa-max-read-fraction",
                "0.4",
            ),
            False,
            True,
        ),
        System(
            "topk_tiered",
            "sglang-psa --sparse-mode topk --psa-kv-home tiered --disable-radix-cache (fixed "
            "2048-token budget; every full block written back to the host tier, cold blocks "
            "leave HBM), decode CUDA graphs",
            ("--sparse-mode", "topk", *_TIERED[2:], "--disable-radix-cache"),
            False,
            True,
        ),
    )
}


@dataclass(frozen=True)
class KVCap:
    """HBM for KV capped to `tokens` tokens of `bytes_per_token` (workload b)."""

    tokens: int
    bytes_per_token: int  # K+V, all layers
    metadata_bytes_per_token: int  # sglang-psa's block metadata in HBM, all layers
    host_tokens: int  # what the host tier must hold: every request of the workload

    @property
    def hbm_bytes(self) -> int:
        return self.tokens * self.bytes_per_token


def keeps_prefix(system: System) -> bool:
    """Whether `system`'s server keeps SGLang's prefix cache: every one but those started
    with `--disable-radix-cache` (the tiered home keeps it over `--radix-cache-backend
    psa`, its default)."""
    return "--disable-radix-cache" not in system.flags


def host_pool_gb(tokens: int, bytes_per_token: int) -> float:
    """`--psa-host-pool-gb` (GiB) holding `tokens` tokens, rounded up to 1/4 GiB plus 1 GiB."""
    return round(-(-tokens * bytes_per_token // 2**28) / 4 + 1.0, 2)


def cap_flags(system: System, cap: KVCap) -> list[str]:
    """Flags that give `system` the same HBM for KV as plain SGLang at `--max-total-tokens
    cap.tokens`. The tiered home keeps block metadata in HBM for every host-tier token;
    the rest of that HBM is its KV pool (whose tokens carry metadata too)."""
    if system.plain or "tiered" not in system.flags:
        return ["--max-total-tokens", str(cap.tokens)]
    pool_gb = host_pool_gb(cap.host_tokens, cap.bytes_per_token)
    pool_tokens = int(pool_gb * 2**30) // cap.bytes_per_token
    left = cap.hbm_bytes - pool_tokens * cap.metadata_bytes_per_token
    if left <= 0:
        raise ValueError(
            f"capped HBM ({cap.hbm_bytes / 2**30:.2f} GiB) does not cover the block metadata "
            f"of {pool_tokens} host-tier tokens"
        )
    tokens = left // (cap.bytes_per_token + cap.metadata_bytes_per_token)
    return ["--max-total-tokens", str(tokens), "--psa-host-pool-gb", f"{pool_gb:g}"]


def launch_command(
    python: str,
    system: System,
    model_dir: str,
    port: int,
    *,
    max_batch: int,
    load_format: str | None = None,
    extra: list[str] | None = None,
    launcher: list[str] | None = None,
) -> list[str]:
    """The `launch_server` argv for `system`; `max_batch` is the largest decode batch the
    workload reaches (the decode graphs plain SGLang captures stop there). `launcher`
    replaces `python -m sglang.launch_server` (a test's fake server)."""
    cmd = [
        *(launcher or [python, "-m", "sglang.launch_server"]),
        "--model-path", model_dir,
        "--host", "127.0.0.1", "--port", str(port),
        "--nccl-port", str(port + NCCL_PORT_OFFSET),
        "--sampling-backend", "pytorch",
        "--mem-fraction-static", f"{MEM_FRACTION_STATIC:g}",
        "--cuda-graph-backend-prefill", "disabled",
        "--decode-log-interval", str(DECODE_LOG_INTERVAL),
        "--random-seed", "0",
    ]  # fmt: skip
    if system.attention_backend:
        cmd += ["--attention-backend", system.attention_backend]
    if load_format:
        cmd += ["--load-format", load_format]
    if system.graphs:
        cmd += ["--cuda-graph-max-bs-decode", str(max(max_batch, 1))]
    flags, extra = list(system.flags), list(extra or [])
    for i in range(len(flags) - 2, -1, -1):  # a flag `extra` sets again: extra's value only
        if flags[i].startswith("--") and flags[i] in extra and not flags[i + 1].startswith("--"):
            del flags[i : i + 2]
    return cmd + flags + extra
