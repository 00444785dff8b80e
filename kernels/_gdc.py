"""Programmatic dependent launch (PDL): the device side, shared by the Triton and Gluon kernels.

A grid launched with the PDL attribute (Triton's ``launch_pdl=True``; CUDA's
``cudaLaunchAttributeProgrammaticStreamSerialization``) may be scheduled before the previous kernel in the stream
has finished, once every program of that kernel has executed ``griddepcontrol.launch_dependents`` (or exited).
Each of our kernels therefore starts with ``griddepcontrol.wait``, which blocks until the previous grid has
completed and its memory operations are visible, and triggers its own dependents either at once (``GDC`` 1) or
after its main loop (``GDC`` 2), so that the launch of the next kernel overlaps this one's work. Early is what
helps one-wave kernels of a few µs (the decode at B = 1); on longer kernels the next grid's programs, resident
and waiting, cost time (measured on the H200: ``kernels/RESULTS.md``). Both instructions are no-ops in a grid
launched without the attribute.
Source: PTX ISA 8.x, "griddepcontrol" (sm_90+); Triton 3.6 ``triton/language/extra/cuda/gdc.py`` emits the
same two instructions. The host side (whether the GPU and Triton support it) is ``_sparse_mla._pdl_supported``.
"""

import triton
import triton.language as tl


@triton.jit
def _gdc_enter(GDC: tl.constexpr):
    # GDC 0: plain launch, nothing emitted. 1 and 2: wait for the previous grid (nothing may be read or written
    # before this); 1 then lets the next grid launch at once, 2 later, at ``_gdc_trigger``.
    if GDC >= 1:
        tl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    if GDC == 1:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _gdc_trigger(GDC: tl.constexpr):
    # GDC 2: let the next grid launch now (placed after a kernel's main loop, so that waiting programs of the next
    # grid do not sit on the SMs during it).
    if GDC == 2:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)
