"""Blackwell (sm_100a) kernels: chapters 09 and 10.

    tmem       the TMEM column plan as data, the lane-quarter rule, allocation sizes
    umma       tcgen05.mma from descriptors: instruction / shared-memory descriptors, lean issue
    config     BlackwellFwdConfig: knobs, derived sizes (ring depth, shared memory, registers)
    softmax    RowSoftmax: fa4_final.softmax.OnlineSoftmax with one row per thread
    primer     one attention tile with every tcgen05 step once (chapter 09's primer)
    fwd        BlackwellForward: the warp-specialised forward, 1- or 2-CTA; compile_forward_sm100,
               compile_only, forward_into, attention
"""
