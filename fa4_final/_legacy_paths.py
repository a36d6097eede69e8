"""Old module paths and names, kept importable while code outside the package moves to the new
ones. Nothing in the package uses them (the package's layers test checks it); deleting them is
deleting the files of LEGACY_PATHS, this file and its one call in fa4_final/__init__.py.

Each legacy path is a small shim module: an alias of the new module (its ``sys.modules`` entry
replaced: the same module object, private names and monkeypatching included) or, where a module
was split, a re-export of its names from where they live now, with adapters here for the
functions whose contract changed. ``attach()`` puts the names the Blackwell kernel modules and
the package's top level used to define back on them.
"""

from __future__ import annotations

import sys

# old path -> the new module (aliases: the very same module object)
ALIASES = {
    "fa4_final.atomics": "fa4_final.common.atomics",
    "fa4_final.autograd": "fa4_final.api.autograd",
    "fa4_final.bwd_post": "fa4_final.common.bwd_post",
    "fa4_final.bwd_pre": "fa4_final.common.bwd_pre",
    "fa4_final.bwd_tiles": "fa4_final.common.bwd_tiles",
    "fa4_final.cache": "fa4_final.runtime.cache",
    "fa4_final.constants": "fa4_final.common.constants",
    "fa4_final.dispatch": "fa4_final.runtime.dispatch",
    "fa4_final.errors": "fa4_final.common.errors",
    "fa4_final.fast_math": "fa4_final.common.fast_math",
    "fa4_final.fragments": "fa4_final.common.fragments",
    "fa4_final.mask": "fa4_final.common.mask",
    "fa4_final.ops": "fa4_final.api.ops",
    "fa4_final.register_plan": "fa4_final.common.register_plan",
    "fa4_final.scheduler": "fa4_final.common.schedule",
    "fa4_final.seqlens": "fa4_final.common.seqlens",
    "fa4_final.softmax": "fa4_final.common.softmax",
    "fa4_final.tiles": "fa4_final.common.tiles",
    "fa4_final.timeline": "fa4_final.common.timeline",
    "fa4_final.varlen": "fa4_final.runtime.varlen",
}

# old path -> where its names live now (re-export shims of split modules)
SPLIT = {
    "fa4_final.backward": "fa4_final.runtime.prologue, fa4_final.hopper.host, "
                          "fa4_final.common.backward (its self-check: the course)",
    "fa4_final.checks": "fa4_final.runtime.checks",
    "fa4_final.compile": "fa4_final.runtime.compile, fa4_final.common.recipe",
    "fa4_final.config": "fa4_final.hopper.config, fa4_final.common.constants",
    "fa4_final.hopper.launch": "fa4_final.hopper.host, fa4_final.runtime.compile, "
                               "fa4_final.runtime.prologue",
    "fa4_final.interface": "fa4_final.api.interface, fa4_final.runtime.prologue",
    "fa4_final.run": "fa4_final.runtime.prologue",
    "fa4_final.varlen_backward": "fa4_final.hopper.host",
}

LEGACY_PATHS = sorted({*ALIASES, *SPLIT, "fa4_final._legacy_paths"})

# names put back on modules that are not shims: module -> {name: "new module:its name"}
ATTACHED = {
    "fa4_final": {"attention": "fa4_final.api.interface:attention",
                  "compile_only": "fa4_final.api.interface:compile_only",
                  "forward": "fa4_final.runtime.prologue:forward",
                  "forward_into": "fa4_final.runtime.prologue:forward_into",
                  "support_table": "fa4_final.runtime.dispatch:support_table"},
    "fa4_final.blackwell.fwd": {"ARCH": "fa4_final.blackwell.host:ARCH",
                                "attention": "fa4_final.api.sm100:attention",
                                "compile_forward_sm100":
                                    "fa4_final._legacy_paths:compile_forward_sm100",
                                "compile_only": "fa4_final._legacy_paths:fwd_compile_only",
                                "fake_forward_args": "fa4_final.blackwell.host:fake_forward_args",
                                "forward_into": "fa4_final._legacy_paths:forward_into"},
    "fa4_final.blackwell.bwd": {"ARCH": "fa4_final.blackwell.host:ARCH",
                                "HopperDqOrder": "fa4_final.common.dq_order:DqOrder",
                                "backward_into": "fa4_final._legacy_paths:backward_into",
                                "compile_backward_sm100":
                                    "fa4_final._legacy_paths:compile_backward_sm100",
                                "compile_only": "fa4_final._legacy_paths:bwd_compile_only",
                                "kernels": "fa4_final._legacy_paths:kernels"},
}


# ----------------------------------------------------------------------------------------------
# adapters: the old contracts over the new functions


def compile_forward(arch="sm_90a", head_dim=128, dtype="bf16", causal=False, config=None,
                    has_window_left=False, has_window_right=False, keep=False, varlen=False,
                    has_seqused_k=False):
    """Old hopper.launch.compile_forward: (compiled, artifacts or None)."""
    from fa4_final.hopper.host import forward_recipe
    from fa4_final.runtime.compile import compile_kernel, compiled

    args = (head_dim, dtype, causal, config, has_window_left, has_window_right, varlen,
            varlen and has_seqused_k)
    if keep:
        recipe = forward_recipe(*args, arch=arch)
        return compile_kernel(recipe.kernels["main"], *recipe.fake_args("main"), arch=arch,
                              keep=True)
    forward_recipe(*args, arch=arch) if arch != "sm_90a" else None  # the arch's refusal
    return compiled(forward_recipe, *args).kernels["main"], None


def compile_backward(arch="sm_90a", head_dim=128, dtype="bf16", causal=False, config=None,
                     deterministic=False, has_window_left=False, has_window_right=False,
                     keep=False, varlen=False, has_seqused_k=False, roles=None):
    """Old backward.compile_backward: ({role: compiled}, {role: artifacts or None})."""
    from fa4_final.runtime.compile import compile_kernel, compiled
    from fa4_final.runtime.dispatch import backend_for_target

    host = backend_for_target(arch).host
    args = (head_dim, dtype, causal, config, deterministic, has_window_left, has_window_right,
            varlen, varlen and has_seqused_k)
    recipe = host.backward_recipe(*args, arch=arch)
    wanted = [r for r in recipe.kernels if roles is None or r in roles]
    if keep:
        pairs = {r: compile_kernel(recipe.kernels[r], *recipe.fake_args(r), arch=arch,
                                   keep=True) for r in wanted}
        return {r: p[0] for r, p in pairs.items()}, {r: p[1] for r, p in pairs.items()}
    kernels = compiled(host.backward_recipe, *args).kernels
    return {r: kernels[r] for r in wanted}, dict.fromkeys(wanted)


def backward_compile_only(arch="sm_90a", head_dim=128, dtype="bf16", causal=False, config=None,
                          deterministic=False, **window):
    """Old backward.compile_only: {role: artifacts}."""
    return compile_backward(arch, head_dim, dtype, causal, config, deterministic, keep=True,
                            **window)[1]


def varlen_compile_only(arch="sm_90a", head_dim=128, dtype="bf16", causal=False, config=None,
                        deterministic=False, **flags):
    """Old varlen_backward.compile_only: {role: artifacts}."""
    return compile_backward(arch, head_dim, dtype, causal, config, deterministic, keep=True,
                            varlen=True, **flags)[1]


def compile_varlen_backward(arch="sm_90a", head_dim=128, dtype="bf16", causal=False,
                            config=None, deterministic=False, has_window_left=False,
                            has_window_right=False, has_seqused_k=False, keep=False):
    return compile_backward(arch, head_dim, dtype, causal, config, deterministic,
                            has_window_left, has_window_right, keep, True, has_seqused_k)


def _hopper():
    from fa4_final.runtime.dispatch import HOPPER

    return HOPPER


def launch_forward_into(q, k, v, out, lse, causal, softmax_scale, window_left, window_right,
                        config=None):
    """Old hopper.launch.forward_into (checked, non-empty inputs)."""
    _hopper().forward(q, k, v, out, lse, causal, softmax_scale, window_left, window_right,
                      config)


def forward_args(q, k, v, out, lse, causal, softmax_scale, window_left, window_right,
                 config=None):
    """Old hopper.launch.forward_args: (compiled kernel, its run-time arguments)."""
    from fa4_final.common.constants import DTYPE_NAMES
    from fa4_final.hopper import host
    from fa4_final.runtime.compile import compiled

    plan = compiled(host.forward_recipe, q.shape[-1], DTYPE_NAMES[q.dtype], causal, config,
                    window_left is not None, window_right is not None and not causal, False,
                    False)
    return plan.kernels["main"], host.forward_args(plan, q, k, v, out, lse, causal,
                                                   softmax_scale, window_left, window_right)


def launch_varlen_forward_into(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                               max_seqlen_k, out, lse, causal, softmax_scale, window_left,
                               window_right, config=None):
    _hopper().varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                             max_seqlen_k, out, lse, causal, softmax_scale, window_left,
                             window_right, config)


def launch_backward_into(q, k, v, out, lse, dout, dq, dk, dv, causal, softmax_scale,
                         window_left, window_right, deterministic=False, config=None,
                         arch="sm_90a"):
    """Old hopper.launch.backward_into and backward.launch_backward (checked inputs)."""
    from fa4_final.runtime.dispatch import backend_for_target, wired

    wired(backend_for_target(arch)).backward(q, k, v, out, lse, dout, dq, dk, dv, causal,
                                             softmax_scale, window_left, window_right,
                                             deterministic, config)


def varlen_backward_launch(q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                           seqused_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                           window_left, window_right, deterministic=False, config=None):
    _hopper().varlen_backward(q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                              seqused_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                              window_left, window_right, deterministic, config)


def compile_forward_sm100(head_dim=128, dtype="bf16", causal=False, config=None,
                          has_window_left=False, has_window_right=False, keep=False):
    return compile_forward("sm_100a", head_dim, dtype, causal, config, has_window_left,
                           has_window_right, keep)


def fwd_compile_only(head_dim=128, dtype="bf16", causal=False, config=None, **window):
    """Old blackwell.fwd.compile_only: the forward's artifacts."""
    return compile_forward("sm_100a", head_dim, dtype, causal, config, keep=True, **window)[1]


def bwd_compile_only(head_dim=128, dtype="bf16", causal=False, config=None, roles=("main",),
                     **window):
    """Old blackwell.bwd.compile_only: {role: artifacts}."""
    return compile_backward("sm_100a", head_dim, dtype, causal, config, keep=True,
                            roles=roles, **window)[1]


def forward_into(q, k, v, out, lse, causal=False, softmax_scale=None, window_left=None,
                 window_right=None, config=None):
    """Old blackwell.fwd.forward_into."""
    from fa4_final.runtime.prologue import forward_into as checked

    return checked(q, k, v, out, lse, causal, softmax_scale, (window_left, window_right),
                   config, target="sm_100a")


def backward_into(q, k, v, out, lse, dout, dq, dk, dv, causal=False, softmax_scale=None,
                  window_size=(None, None), deterministic=False, config=None):
    """Old blackwell.bwd.backward_into."""
    from fa4_final.runtime.prologue import backward_into as checked

    return checked(q, k, v, out, lse, dout, dq, dk, dv, causal, softmax_scale, window_size,
                   deterministic, config, target="sm_100a")


def kernels(dtype="bf16", head_dim=128, causal=False, config=None, has_window_left=False,
            has_window_right=False):
    """Old blackwell.bwd.kernels: {"pre", "main", "post"}."""
    from fa4_final.blackwell.host import backward_recipe

    return backward_recipe(head_dim, dtype, causal, config, False, has_window_left,
                           has_window_right).kernels


def compile_backward_sm100(head_dim=128, dtype="bf16", causal=False, config=None, keep=False,
                           roles=("pre", "main", "post"), **window):
    return compile_backward("sm_100a", head_dim, dtype, causal, config, keep=keep,
                            roles=roles, **window)


def attach() -> None:
    """Put ATTACHED's names back on their old modules."""
    import importlib

    for module, names in ATTACHED.items():
        target = importlib.import_module(module)
        for name, where in names.items():
            home, attr = where.split(":")
            source = sys.modules[__name__] if home == __name__ else importlib.import_module(home)
            setattr(target, name, getattr(source, attr))
