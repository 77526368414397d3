"""Process-wide settings of the runtime, set by activation and read on the hot path."""

import os


class Settings:
    """Mutable settings; one instance, `settings`, lives for the process."""

    def __init__(self):
        self.strict = False
        # Compare each mapping with torch's meta kernels the first time a signature is seen.
        self.check_signatures = True
        # JAX platform that 'cuda' names ('cpu', 'gpu', 'tpu'); None until activation picks one.
        self.platform = None
        # Run each table entry as one compiled XLA call (runtime/compiled_ops.py).
        self.compile_ops = os.environ.get("BRIDGE_COMPILE_OPS", "1") != "0"
        # Run small integer and bool ops by torch's CPU kernels where their tensors are on the
        # host already, or where they would compile yet another shape (runtime/dispatch.py
        # _on_host). Off where the mappings themselves are measured.
        self.host_int_ops = os.environ.get("BRIDGE_HOST_INT_OPS", "1") != "0"
        # Record in-place updates of floating-point tensors and run them together as one
        # program at the first read of what they wrote (runtime/deferred.py).
        self.defer_updates = os.environ.get("BRIDGE_DEFER_UPDATES", "1") != "0"
        # HF `generate` left to its default cache decodes with HF's StaticCache instead of the
        # DynamicCache that grows every token (bridge/patches/hf_generate.py).
        self.hf_static_cache = os.environ.get("BRIDGE_HF_STATIC_CACHE", "1") != "0"
        # HF Switch Transformers' experts traced with fixed shapes (bridge/patches/hf_experts.py);
        # off, their loop breaks the region as before.
        self.hf_fixed_experts = os.environ.get("BRIDGE_HF_FIXED_EXPERTS", "1") != "0"
        # Execution mode: "captured" (regions run as compiled programs) or "eager" (op by op).
        self.mode = os.environ.get("BRIDGE_MODE", "captured")
        # Depth of region traces in progress (runtime/capture.py); table entries then run inline.
        self.tracing = 0
        # Whether the trace in progress is differentiated (the region was called with grad mode
        # on): then what the region computes with grad mode off (a `torch.no_grad()` block in
        # it) is cut from JAX's gradient, as torch's autograd does not record it.
        self.tracing_for_grad = False
        # Inside an op that takes torch's derivative formula (runtime/torch_gradients.py): the
        # ops it runs through need no rule of their own.
        self.in_torch_gradient = False
        # Inside a torch function whose C++ composite makes host tensors "like" its bridge
        # inputs (bridge/patches/composites.py): those meet bridge tensors without the
        # two-device error (runtime/dispatch.py).
        self.in_host_making_composite = 0
        # Split runs (a region whose outputs get gradients from outside it), what the forward
        # program keeps for the backward: "matmuls" (the results of matmuls and convolutions;
        # the backward recomputes the rest), "all" (every residual of jax.vjp) or "recompute"
        # (nothing; the backward runs the forward again).
        self.residuals = os.environ.get("BRIDGE_RESIDUALS", "matmuls")
        # Fused runs (forward and gradients in one program), what the forward keeps for the
        # backward part: "all" (whatever XLA keeps) or "matmuls" (as for split runs).
        self.fused_residuals = os.environ.get("BRIDGE_FUSED_RESIDUALS", "all")
        # The name scripts see for bridge devices.
        self.device_type = "cuda"
        # 2-d convolutions produce their result channels-last (NHWC), then transpose it to
        # torch's NCHW: None decides by platform (runtime/precision.py conv_channels_last()).
        flag = os.environ.get("BRIDGE_CONV_CHANNELS_LAST")
        self.conv_channels_last = None if flag is None else flag != "0"
        # float32 attention on NVIDIA GPUs runs as one Pallas (Triton) kernel
        # (op_mappings/flash_attention.py); "0" keeps XLA's blocked form instead.
        self.fused_attention = os.environ.get("BRIDGE_FUSED_ATTENTION", "1") != "0"
        # Where Adam's moments and SGD's momentum buffers live (runtime/optimizers.py): "flat"
        # (one array per kind, each parameter's state tensor a view into it), "separate" (an
        # array per tensor, as torch keeps them); None decides by size (optimizer_state()).
        self.optimizer_state = os.environ.get("BRIDGE_OPTIMIZER_STATE") or None
        # The parameters an Adam, AdamW or SGD step updates become views into one flat array per
        # group once the step's structure repeats (runtime/flat.py), so that the update and the
        # captured regions take them as one array; "0" keeps an array per parameter.
        self.flat_parameters = os.environ.get("BRIDGE_FLAT_PARAMETERS", "1") != "0"
        # Compile a captured region's backward before its first split forward runs
        # (runtime/capture.py `_compile_backward`): None decides by platform (GPUs only).
        self.compile_backward_ahead = None
        # An entry that reads something its registration does not declare (runtime/compiled_ops.py
        # _undeclared) is an error rather than handled: the test suite sets it.
        self.check_facts = os.environ.get("BRIDGE_CHECK_FACTS", "0") == "1"


    @property
    def capture(self):
        return self.mode == "captured"


settings = Settings()

# The name (jax.ad_checkpoint.checkpoint_name) of small values a mapping marks for a captured
# region's backward to keep rather than recompute from large ones (batch statistics): split
# runs keep matmul and convolution results and these (runtime/capture.py).
KEEP_FOR_BACKWARD = "bridge_keep_for_backward"


# Above this many bytes of parameters in a group, the state is kept separate by default: the
# flat layout's update joins the gradients into one more copy of them (a 7.5 B model sharded
# over 2 GPUs ran out of memory in its first Adam step that way), while the host cost it saves,
# an array per parameter and call, is small beside such a step.
SEPARATE_STATE_BYTES = 1 << 30


def optimizer_state(parameter_bytes=0):
    """The optimizer state's layout: "flat" or "separate" (settings.optimizer_state; by default
    flat, separate for a group of more than SEPARATE_STATE_BYTES of parameters)."""
    layout = settings.optimizer_state
    if layout is None:
        return "separate" if parameter_bytes > SEPARATE_STATE_BYTES else "flat"
    if layout not in ("flat", "separate"):
        raise ValueError(f"BRIDGE_OPTIMIZER_STATE={layout!r}: the optimizer state's layout is 'flat' or 'separate'")
    return layout
