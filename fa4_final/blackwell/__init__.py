"""Blackwell (sm_100a) kernels (compiled and checked; never run on a GPU).

    tmem       the TMEM column plan as data, the lane-quarter rule, allocation sizes
    umma       tcgen05.mma from descriptors: instruction / shared-memory descriptors, lean issue
    roles      warp roles as data: the checks every role table keeps (setmaxnreg per SM
               sub-partition: fa4_final.common.register_plan); cache key and role lookup
    config     BlackwellFwdConfig, BlackwellBwdConfig: knobs, derived sizes (ring depth, shared
               memory, registers, the TMEM plans)
    softmax    RowSoftmax: fa4_final.common.softmax.OnlineSoftmax with one row per thread
    peer       the steps of a tile exchange between the CTAs of a pair (st.async, cluster-
               scope waits, proxy fences): the pair backward's and the H200 probes'
    fwd        BlackwellForward: the warp-specialised forward, 1- or 2-CTA
    bwd        BlackwellBackward: the 1-CTA backward, TMEM accumulators, dQ in the shared
               accumulator order (common: bwd_pre, bwd_post, dq_order)
    bwd_pair   BlackwellBackwardPair: its 2-CTA mode (BlackwellBwdConfig(two_cta=True)): a CTA
               pair per 256 keys, cta_group::2 GEMMs, dS exchanged through distributed shared
               memory, half the dQ adds per CTA
    host       recipes and launches, the contract of fa4_final.hopper.host
"""
