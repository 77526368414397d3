"""The mapping tables: one JAX implementation per torch operator, grouped by op family.

Importing this package registers every entry into `runtime.registry.MAPPINGS`.

How an entry is written (see runtime/registry.py for the decorator):
- Register on the ATen operator object (`aten.add` for every functional
  overload, or `aten.add.Tensor` for one). In-place (`add_`) and `out=`
  overloads are derived by the runtime from the functional entry; view ops
  return the view's value and the runtime keeps the aliasing.
- The body takes the ATen schema's arguments: tensors as `jax.Array`s (lists
  of tensors as lists), optional tensors as None, Scalars as Python numbers,
  dtypes as torch dtypes (convert with `jnp_dtype`), device/layout/memory
  format arguments as given (ignore them). It returns jax arrays shaped as the
  schema's outputs.
- Bodies are pure and traceable (jnp/lax only, no host sync, no Python branch
  on array values) so that the same table serves eager and captured execution.
- Type promotion belongs to the decorator (`promote=`), not to the body.
"""

from . import (  # noqa: F401  (imported for their registrations)
    elementwise,
    reductions,
    shapes,
    indexing,
    factories,
    linalg,
    grouped_matmul,
    convolution,
    pooling,
    resampling,
    normalization,
    losses,
    activations,
    attention,
    random,
    foreach,
    prims,
    amp,
    optimizers,
    fft,
    factorizations,
    special,
    distances,
    recurrent,
    traits,
    control_flow,
)
