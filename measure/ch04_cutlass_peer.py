"""Chapter 04's kernel next to CUTLASS's own Ampere-style FlashAttention-2 example, on one GPU.

CUTLASS ships a CuTe DSL example of the same design, ``flash_attention_v2.py`` (cp.async +
mma.sync, 128 x 64 tiles, 4 warps). Its own benchmark fills Q, K and V with integers in [-2, 2);
the course benchmarks with normal random values, and kernels can run at different speeds on the
two (we think power: fewer bits switch in the tensor cores, so the chip may hold a higher clock;
the clock is not read here). This driver times both kernels, the course kernel's portable tile
and SDPA's flash backend (FlashAttention-2) on both kinds of input in one process, in rounds, so
each ratio compares numbers from the same run and the same data:

    python -m measure.ch04_cutlass_peer --cutlass-example PATH/TO/flash_attention_v2.py

The example is not part of this course (and not copied into it): point at a CUTLASS checkout
(github.com/NVIDIA/cutlass, examples/python/CuTeDSL/cute/ampere/kernel/attention/). Rows are
saved to results/<gpu>/ch04_cutlass_peer.json; ``solutions.ch04_peers`` reads them.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from functools import partial
from pathlib import Path

from solutions.ch04_peers import DATA, RESULTS, SHAPE, summary

PRODUCES = [(f"results/h200/{RESULTS}.json",
             "python -m measure.ch04_cutlass_peer --cutlass-example "
             "<cutlass>/flash_attention_v2.py",
             "chapter 04's kernel, its portable tile, CUTLASS's Ampere FA2 example and SDPA flash "
             "in rounds, on random normal and small-integer inputs")]


def load_example(path: str):
    """The example module from a CUTLASS checkout (it is run as a peer, never copied)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no CUTLASS example at {path}; pass --cutlass-example with the "
                                "path of flash_attention_v2.py from a CUTLASS checkout")
    spec = importlib.util.spec_from_file_location("cutlass_fa2_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cutlass_runner(module, q, k, v, causal: bool, m_block: int = 128, n_block: int = 64):
    """Compile the example for these tensors; return (run, max |out - SDPA|)."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    import torch
    from cutlass import Float32
    from cutlass.cute.runtime import from_dlpack

    out = torch.empty_like(q)

    def as_cute(t):  # how the example's own runner passes its tensors
        return (from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=3)
                .mark_compact_shape_dynamic(mode=3, stride_order=t.dim_order(), divisibility=8))

    args = [as_cute(t) for t in (q, k, v, out)]
    scale = Float32(q.shape[-1] ** -0.5)
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    kernel = module.FlashAttentionForwardAmpere(q.shape[-1], m_block, n_block, 128, causal)
    compiled = cute.compile(kernel, *args, scale, stream)

    def run():
        compiled(*args, scale, stream)

    run()
    torch.cuda.synchronize()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
    ).transpose(1, 2)
    return run, (out.float() - ref.float()).abs().max().item()


def inputs(data: str, seed: int):
    import torch

    from utils.reference import random_qkv

    b, s, h, d = SHAPE["b"], SHAPE["s"], SHAPE["h"], SHAPE["d"]
    if data == "randn":
        q, k, v, _ = random_qkv(b, s, h, d, device="cuda", seed=seed)
        return q, k, v
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randint(-2, 2, (b, s, h, d), device="cuda", generator=gen)
                 .to(torch.bfloat16) for _ in range(3))


def measure(example_path: str, rounds: int = 3, rep: int = 30) -> list[dict]:
    from solutions import ch04_flash_ampere as ch04
    from utils.bench import attention_flops, peers, time_cuda

    module = load_example(example_path)
    sdpa = peers()["sdpa_flash"]
    rows = []
    for causal in (False, True):
        flops = attention_flops(SHAPE["b"], SHAPE["h"], SHAPE["s"], SHAPE["s"], SHAPE["d"],
                                causal)
        for data in DATA:
            q, k, v = inputs(data, seed=1234)
            run, err = cutlass_runner(module, q, k, v, causal)
            contenders = {
                "sdpa_flash": partial(sdpa, q, k, v, causal),
                "flash_ampere": partial(ch04.attention, q, k, v, causal),
                "flash_ampere_portable": partial(ch04.attention, q, k, v, causal,
                                                 config=ch04.DEFAULT_CONFIGS[SHAPE["d"]]),
                "cutlass_example_128x64": run,
            }
            for rnd in range(rounds):  # interleaved, so drift hits every contender alike
                for impl, fn in contenders.items():
                    t = time_cuda(fn, rep=rep)
                    rows.append({"impl": impl, "data": data, "causal": causal, "round": rnd,
                                 "pass": "fwd", "dtype": "bf16", **SHAPE,
                                 "ms": t.median_ms, "tflops": t.tflops(flops),
                                 "cutlass_max_abs_err_vs_sdpa": err})
                    print(f"  causal={causal!s:5s} {data:9s} round {rnd} {impl:24s} "
                          f"{t.tflops(flops):6.1f} TFLOP/s", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cutlass-example", required=True,
                        help="path of CUTLASS's examples/python/CuTeDSL/cute/ampere/kernel/"
                             "attention/flash_attention_v2.py")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing measured")
        return 1
    from utils.results import save

    rows = measure(args.cutlass_example, rounds=args.rounds)
    print("\n".join(summary(rows)))
    path = save(RESULTS, rows, command="python -m measure.ch04_cutlass_peer --cutlass-example "
                f"<cutlass>/{Path(args.cutlass_example).name}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
