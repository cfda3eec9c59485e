"""A Triton (or Gluon) kernel compiled for sm_90a without a GPU, as a launch with given arguments would compile it:
what the SASS proxies (``benchmarks/bench_kernel_sass.py``, ``benchmarks/bench_gluon_sass.py``) read."""

from __future__ import annotations

__all__ = ["compile_sm90"]


def compile_sm90(fn, args, kwargs, gluon: bool = False):
    """Triton's compiled kernel of the ``@triton.jit`` (or, with ``gluon``, ``@gluon.jit``) function ``fn`` for
    sm_90a, bound to ``args``/``kwargs`` by the JIT's own binder: the same type, alignment and ==1
    specialisations as a real launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource  # noqa: N814

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
