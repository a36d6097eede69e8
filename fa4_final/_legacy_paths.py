"""Old module paths, kept importable while the course's notebooks and drivers move to the new
ones. Each legacy path is a small shim module: an alias of the new module (``sys.modules`` entry
replaced: the same module object, private names and monkeypatching included) or, where a module
was split, a re-export of the names it defined from where they live now. Nothing in the package
imports a legacy path (tests/test_fa4_final_layers.py); deleting the shims is deleting the files
named here, this file, and LEGACY_PATHS's test.
"""

# old path -> the new module (aliases: the very same module object)
ALIASES = {
    "fa4_final.atomics": "fa4_final.common.atomics",
    "fa4_final.bwd_post": "fa4_final.common.bwd_post",
    "fa4_final.bwd_pre": "fa4_final.common.bwd_pre",
    "fa4_final.bwd_tiles": "fa4_final.common.bwd_tiles",
    "fa4_final.constants": "fa4_final.common.constants",
    "fa4_final.errors": "fa4_final.common.errors",
    "fa4_final.fast_math": "fa4_final.common.fast_math",
    "fa4_final.fragments": "fa4_final.common.fragments",
    "fa4_final.mask": "fa4_final.common.mask",
    "fa4_final.register_plan": "fa4_final.common.register_plan",
    "fa4_final.scheduler": "fa4_final.common.schedule",
    "fa4_final.seqlens": "fa4_final.common.seqlens",
    "fa4_final.softmax": "fa4_final.common.softmax",
    "fa4_final.tiles": "fa4_final.common.tiles",
    "fa4_final.timeline": "fa4_final.common.timeline",
}

# old path -> the modules its names now come from (re-export shims of split modules)
SPLIT = {}

LEGACY_PATHS = sorted({**ALIASES, **SPLIT})
