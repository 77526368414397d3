"""Optimizer updates as one compiled program per step: Adam/AdamW and SGD.

torch's optimizers update each parameter with a dozen small ops (the `foreach` path for
device tensors); on the bridge each is a dispatch. Here the whole update of a parameter
group is one `jax.jit` program. The arithmetic follows torch's non-capturable `foreach`
implementation op for op, in the parameters' dtype: per-step scalars (learning rate, bias
corrections) are computed on the host in Python floats exactly as torch computes them and
passed in as arrays, so a learning-rate schedule never recompiles; the remaining
hyperparameters are part of the program's static key.

torch calls the update once per parameter group; a step's groups wait for the step's end and run
as one program (`one_program`, `submit`), so a step is one program however many groups it has.

A `clip_grad_norm_` just before the step is folded into it (`PendingClip`): the clip waits
until the optimizer takes the gradients, and the update program computes the norm, the
coefficient and the scaled gradients itself, as torch's clip does. That saves a program call
over every gradient per step. Anything else that reads a waiting gradient, or the returned
norm, runs the clip first, so every value a script can see is the clipped one.

DistributedDataParallel's average of the gradients over the processes waits for the step the same
way (`PendingReduction`): the step's program runs the collective first, so the gradients cross
the processes inside the step instead of in a program of their own after the backward.

The optimizer state (Adam's moments, SGD's momentum buffers) lives in one flat array per
kind, and each parameter's state tensor is a view into it (`flat_state`): the update program
then takes and returns two arrays instead of two per parameter. Each array crossing a program
boundary costs the host a few microseconds in JAX and XLA's runtime; for GPT-2's 148
parameters, per-parameter state made the update's call cost about as much as its kernels.
"""

import contextlib
import functools
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from . import distributed, flat, stats
from .config import settings
from .registry import MAPPINGS, aten
from .tensor import BridgeTensor, read_value, read_values, root_of, settle, write_value


_split, _join = flat.split, flat.join
join_gradients = _join  # how a flat update joins its gradients (benchmarks/gradient_join.py tries others)
flat_state, flat_members = flat.flat_state, flat.flat_members


def device_step_counts(root):
    """Step counts held on the device (fused=True, capturable=True: 0-dim tensors), as torch's
    step advances them by one, from their flat root (`flat_state` of the step tensors): (the
    root, the new counts as a float64 numpy array, and `advanced(new counts)`, which writes them once
    the update program has made them from the root's array, which it takes and returns one
    higher).

    The root also remembers the counts on the host: read from the device once (the first
    step, or after anything else wrote them), then kept, so a step needs no device-to-host copy
    and sends no counts."""
    known = getattr(root, "_host_counts", None)
    if known is not None and known[0] == root._generation:
        counts = known[1]
    else:
        counts = np.asarray(read_value(root), dtype=np.float64)
    counts = counts + 1.0

    def advanced(value):
        write_value(root, value)
        root._host_counts = (root._generation, counts)

    return root, counts, advanced


# ---------------------------------------------------------------- clip_grad_norm_ folded into the step


def clip_coefficient(grads, max_norm, norm_type):
    """torch's clip_grad_norm_ arithmetic, through the table entries its ops take: the total
    norm (the norm of the per-gradient norms) and the clamped coefficient."""

    def call(op, *args):
        return MAPPINGS[op].call(*args)

    norms = call(aten._foreach_norm.Scalar, grads, norm_type)
    total = call(aten.linalg_vector_norm.default, call(aten.stack.default, norms), norm_type)
    # max_norm / (total + 1e-6), as torch runs it: a reciprocal, then a product.
    scale = call(aten.mul.Tensor, call(aten.reciprocal.default, call(aten.add.Tensor, total, 1e-6)), max_norm)
    return total, call(aten.clamp.default, scale, None, 1.0)


def _clipped(grads, clip_grads, coefficient, max_norm, norm_type):
    """The gradients an update uses: scaled by the clip's coefficient (computed here from all
    the clip's gradients when not known yet). Returns (grads, (total, coefficient) or None)."""
    if clip_grads is None and coefficient is None:
        return grads, None
    total = None
    if coefficient is None:
        total, coefficient = clip_coefficient(clip_grads, max_norm, norm_type)
    multiply = MAPPINGS[aten.mul.Tensor].call
    return [multiply(grad, coefficient) for grad in grads], (total, coefficient)


_scale_all = jax.jit(lambda values, coefficient: [MAPPINGS[aten.mul.Tensor].call(value, coefficient) for value in values])


class PendingClip:
    """A clip_grad_norm_ that waits for the optimizer's step (see the module's docstring).

    Its gradients (their roots: a parameter's `.grad` is often an alias of the array the
    backward made) and the norm tensor it returned hold it as their `_pending` work. The first
    update program that takes its gradients computes the norm and the coefficient; gradients
    read after that are scaled by the known coefficient, all at once."""

    def __init__(self, grads, max_norm, norm_type, run_clip):
        self.reduction = PendingReduction.of(grads)  # DDP's average, which comes first
        self.grads = list(grads)  # until the coefficient is known: the norm needs them all
        self.max_norm, self.norm_type = max_norm, norm_type
        self.run_clip = run_clip  # clips the gradients now and returns the total norm tensor
        self.coefficient = None
        self.waiting = [weakref.ref(grad) for grad in grads]
        for grad in grads:
            grad._pending = self
            grad._generation += 1  # views and aliases read through the root again
        # The total norm it returns: known once the clip has run.
        self.norm = BridgeTensor(jax.ShapeDtypeStruct((), grads[0]._value.dtype), grads[0]._index)
        self.norm._pending = self

    def taken(self, total, coefficient):
        """An update program computed the clip: the norm is known, the gradients may scale lazily."""
        if self.coefficient is None:
            self.coefficient = coefficient
            self._set_norm(total)
            self.grads = None

    def resolve(self, tensor):
        if self.reduction is not None and not self.reduction.done:
            self.reduction.resolve()
        if self.coefficient is None:
            grads, self.grads = self.grads, None
            self._release(grads)
            self._set_norm(read_value(self.run_clip(grads)))  # no gradient waits any more
            return
        waiting = [grad for grad in (ref() for ref in self.waiting) if grad is not None and grad._pending is self]
        self.waiting = []
        self._release(waiting)
        for grad, value in zip(waiting, _scale_all([grad._value for grad in waiting], self.coefficient)):
            grad._value = value
            grad._generation += 1

    @staticmethod
    def of(grads):
        """The clip all of `grads` wait for (one clip, whose coefficient an update may compute
        or use), else None."""
        roots = [root_of(grad) for grad in grads]
        clip = roots[0]._pending if roots else None
        if not isinstance(clip, PendingClip) or any(root._pending is not clip or grad._chain for root, grad in zip(roots, grads)):
            return None
        return clip

    def update_inputs(self, grads):
        """The arguments an update program takes for this clip: (unclipped gradient values, all
        the clip's gradient values or None, coefficient or None)."""
        reduction = self.reduction
        if reduction is not None and not reduction.done and not take_reduction(reduction):
            reduction.resolve()
        values = [root_of(grad)._value for grad in grads]
        if self.coefficient is not None:
            return values, None, self.coefficient
        return values, [grad._value for grad in self.grads], None

    def _release(self, grads):
        for grad in grads:
            if grad._pending is self:
                grad._pending = None

    def _set_norm(self, total):
        if self.norm._pending is self:
            self.norm._value = total
            self.norm._pending = None


class PendingReduction:
    """DistributedDataParallel's average of the gradients, from the end of the backward until the
    optimizer's step takes it into its program (`_Batch.run`). Its gradients' roots hold it as
    their `_pending` work (or a PendingClip over them holds it): anything else that reads or
    writes one runs it alone first. Every rank must run it in the same program, so before either
    the ranks vote (`reducer.agree`): a rank that ran it alone makes every rank do so.

    `reducer` is the module's: `group`, `agree(in_step)`, and `alone(values)`, the averaged
    values by a collective program of their own (after `agree`)."""

    def __init__(self, roots, reducer):
        self.roots = list(roots)
        self.reducer = reducer
        self.done = False
        for root in self.roots:
            settle(root)  # an accumulation still waiting (runtime.deferred) runs first
            root._pending = self
        _waiting.add(self)

    @staticmethod
    def of(grads):
        """The reduction all of `grads` wait for, directly or under a waiting clip, else None."""
        roots = [root_of(grad) for grad in grads]
        first = roots[0]._pending if roots else None
        reduction = first.reduction if isinstance(first, PendingClip) else first
        if not isinstance(reduction, PendingReduction) or reduction.done:
            return None
        if any(grad._chain or root._pending is not first for root, grad in zip(roots, grads)):
            return None
        return reduction

    def resolve(self, tensor=None):
        if not self.done:
            self.reducer.agree(False)
            self.run_alone()

    def run_alone(self):
        """The average by its own program (the ranks have agreed on it)."""
        values = [root._value for root in self.roots]
        self.finish(self.reducer.alone(values))

    def finish(self, values, in_step=False):
        stats.ddp_averages["in_step" if in_step else "alone"] += 1
        self.done = True
        for root, value in zip(self.roots, values):
            if root._pending is self:
                root._pending = None
            root._value = value
            root._generation += 1  # views and aliases read through the root again


def _lerp(start, end, weight):
    # torch's lerp: start + w * (end - start) below w = 0.5, else end - (end - start) * (1 - w).
    return jnp.where(
        jnp.abs(weight) < 0.5, start + weight * (end - start), end - (end - start) * (1 - weight)
    )


def _adam_moments(exp_avg, exp_avg_sq, grad, beta1, beta2, dtype):
    """torch's foreach Adam on the moments: exp_avg.lerp_(grad, 1 - beta1), then
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)."""
    exp_avg = _lerp(exp_avg, grad, jnp.asarray(1 - beta1, dtype))
    exp_avg_sq = exp_avg_sq * jnp.asarray(beta2, dtype)
    return exp_avg, exp_avg_sq + jnp.asarray(1 - beta2, dtype) * grad * grad


def adam_update(
    params, grads, avgs, sqs, maxes, scalars, clip_grads=None, coefficient=None, counts=None,
    *, beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize, separate=False, max_norm=None, norm_type=None,
    flat_shapes=None, flat_updated=None, uniform=False, joined_grads=None,
):
    """One Adam/AdamW step; returns the new (params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs or
    None, (total norm, clip coefficient) or None, step counts or None). `counts`: step counts
    held on the device (device_step_counts), returned one higher. The moments are flat arrays (`flat_state`),
    or with `separate` lists of arrays, one per parameter; `scalars` (one transfer from the host)
    holds 1 - lr * weight_decay, then -lr / (1 - beta1**step) per parameter, then
    sqrt(1 - beta2**step) per parameter. A folded clip_grad_norm_ (`PendingClip`) gives
    `clip_grads` (to compute the coefficient) or the `coefficient`, and `max_norm` and
    `norm_type`. With `flat_shapes`, `params` is a flat root's array (runtime/flat.py) in a list,
    and so are the new parameters; the update is of its members at `flat_updated` (None: all),
    the others' spans pass through. `uniform`: every parameter has taken as many steps (its
    scalars are the first parameter's). `joined_grads`: the first gradient is a flat array
    holding the gradients at these places (`_unjoined`)."""
    if flat_shapes is not None and flat_updated is None and uniform and not separate:
        # The whole root at once, as one parameter with the joined gradients: one elementwise
        # pass over it and the moments, each updated in its donated buffer.
        whole = jnp.stack([scalars[0], scalars[1], scalars[1 + len(flat_shapes)]])
        grads = [join_gradients(_unjoined(grads, joined_grads, flat_shapes))]
        *result, _ = _adam_update(
            params, grads, avgs, sqs, maxes, whole, clip_grads, coefficient, beta1=beta1, beta2=beta2,
            eps=eps, weight_decay=weight_decay, decoupled=decoupled, amsgrad=amsgrad, maximize=maximize,
            max_norm=max_norm, norm_type=norm_type,
        )
        return (*result, _advanced(counts))
    params, pieces = _from_flat(params, flat_shapes, flat_updated)
    grads, clip = _clipped(grads, clip_grads, coefficient, max_norm, norm_type)
    count = len(params)
    decay, step_sizes, bias2_sqrts = scalars[0], scalars[1 : 1 + count], scalars[1 + count :]
    dtype = params[0].dtype  # one dtype per group (bridge.patches.optim._uniform)
    if maximize:
        grads = [-grad for grad in grads]
    if weight_decay != 0 and not decoupled:
        grads = [grad + jnp.asarray(weight_decay, dtype) * param for grad, param in zip(grads, params)]
    if separate:
        # Each parameter's moments in arrays of their own, donated: each parameter's update is
        # one elementwise pass over its parameter, gradient and moments.
        moments = [_adam_moments(avg, sq, grad, beta1, beta2, dtype) for avg, sq, grad in zip(avgs, sqs, grads)]
        avgs, sqs = [avg for avg, _ in moments], [sq for _, sq in moments]
        if amsgrad:
            maxes = [jnp.maximum(largest, sq) for largest, sq in zip(maxes, sqs)]
        per_parameter = zip(params, avgs, maxes if amsgrad else sqs)
    else:
        # The moments as whole flat arrays: elementwise, so XLA updates their donated buffers in
        # place, and each parameter's update reads its slice of the new moments (computed per
        # parameter and concatenated, each parameter's fusion computed them again; updated
        # span by span in place, slower: benchmarks/optimizer_update.py).
        avgs, sqs = _adam_moments(avgs, sqs, _join(grads), beta1, beta2, dtype)
        if amsgrad:
            maxes = jnp.maximum(maxes, sqs)
        per_parameter = zip(params, _split(avgs, params), _split(maxes if amsgrad else sqs, params))
    new_params = []
    for i, (param, exp_avg, second) in enumerate(per_parameter):
        if weight_decay != 0 and decoupled:
            param = param * decay.astype(dtype)
        denom = jnp.sqrt(second) / bias2_sqrts[i].astype(dtype) + jnp.asarray(eps, dtype)
        new_params.append(param + step_sizes[i].astype(dtype) * (exp_avg / denom))
    return _to_flat(new_params, pieces, flat_updated), avgs, sqs, (maxes if amsgrad else None), clip, _advanced(counts)


_adam_update = adam_update  # (the name adam_update is the jitted program's below)


def _advanced(counts):
    return None if counts is None else counts + 1


def _unjoined(grads, joined, shapes):
    """An update's gradients, one per parameter, where the first of `grads` is a flat array
    holding those at the places `joined` (a fused run's small gradients joined,
    runtime/capture.py) and the rest are the others' in order. (Joined again whole right after:
    XLA reads each element from its source inside the update's elementwise pass.)"""
    if joined is None:
        return grads
    return flat.merge(_split(grads[0], [shapes[place] for place in joined]), grads[1:], joined, len(shapes))


def _from_flat(params, shapes, updated):
    """The parameters an update takes, and the flat root's pieces (None without a flat root)."""
    if shapes is None:
        return params, None
    pieces = _split(params[0], shapes)
    return (pieces if updated is None else [pieces[i] for i in updated]), pieces


def _to_flat(new_params, pieces, updated):
    """The update's new parameters as it returns them: the flat root's new array in a list."""
    if pieces is None:
        return new_params
    if updated is not None:
        pieces = list(pieces)
        for i, new in zip(updated, new_params):
            pieces[i] = new
        new_params = pieces
    return [_join(new_params)]


def sgd_update(
    params, grads, buffers, lr, clip_grads=None, coefficient=None,
    *, momentum, dampening, weight_decay, nesterov, maximize, first, separate=False, max_norm=None, norm_type=None,
    flat_shapes=None, flat_updated=None, joined_grads=None,
):
    """One SGD step; returns (new params, new momentum buffers or None, (total norm, clip
    coefficient) or None). The buffers are one flat array, or with `separate` a list of arrays,
    one per parameter. `first`: no buffers yet (torch starts them as a copy of the gradient).
    The clip arguments, `flat_shapes`, `flat_updated` and `joined_grads` are adam_update's."""
    if flat_shapes is not None and flat_updated is None and not separate:
        # The whole root at once, as one parameter (see adam_update).
        grads = [_join(_unjoined(grads, joined_grads, flat_shapes))]
        return _sgd_update(
            params, grads, buffers, lr, clip_grads, coefficient, momentum=momentum, dampening=dampening,
            weight_decay=weight_decay, nesterov=nesterov, maximize=maximize, first=first, max_norm=max_norm,
            norm_type=norm_type,
        )
    params, pieces = _from_flat(params, flat_shapes, flat_updated)
    grads, clip = _clipped(grads, clip_grads, coefficient, max_norm, norm_type)
    dtype = params[0].dtype
    if maximize:
        grads = [-grad for grad in grads]
    if weight_decay != 0:
        grads = [grad + jnp.asarray(weight_decay, dtype) * param for grad, param in zip(grads, params)]
    if momentum == 0:
        steps, buffers = grads, None
    else:
        scale, damped = jnp.asarray(momentum, dtype), jnp.asarray(1 - dampening, dtype)
        if separate:
            # torch starts each buffer as a copy of the gradient (`first`): a copy, not the
            # gradient's array handed back (the buffers are donated to the next step).
            buffers = [jnp.copy(grad) for grad in grads] if first else [buffer * scale + damped * grad for buffer, grad in zip(buffers, grads)]
            steps_from = buffers
        elif first:
            buffers = _join(grads)
            steps_from = _split(buffers, params)
        elif (settings.platform or jax.default_backend()) != "gpu":
            # XLA's CPU backend copies the flat array for each span (_Spans): the gradients
            # joined, the buffers updated whole, each parameter reading its slice.
            buffers = buffers * scale + damped * _join(grads)
            steps_from = _split(buffers, params)
        else:
            # On GPUs each buffer is updated in its span of the flat array, in place (_Spans).
            spans = _Spans(buffers)
            steps_from = [spans.write(i, spans.read(i, param) * scale + damped * grad) for i, (param, grad) in enumerate(zip(params, grads))]
            buffers = spans.flat
        if nesterov:
            steps = [grad + scale * buffer for grad, buffer in zip(grads, steps_from)]
        else:
            steps = steps_from
    new_params = [param + (-lr).astype(dtype) * step for param, step in zip(params, steps)]
    return _to_flat(new_params, pieces, flat_updated), buffers, clip


_sgd_update = sgd_update  # (the name sgd_update is the jitted program's below)


class _Spans:
    """A flat state array read and written one parameter's span at a time, in order. Each span
    is read from the array as it stands (after the spans before it were written), so that the
    donated input buffer has no reader left once written: XLA then writes every span in place
    (a dynamic-update-slice on the buffer) instead of copying the whole array first."""

    def __init__(self, flat):
        self.flat = flat
        self.start = 0
        self.index = -1

    def read(self, index, like):
        if index != self.index:
            self.start += 0 if self.index < 0 else self.size
            self.index, self.size = index, like.size
        return jax.lax.slice_in_dim(self.flat, self.start, self.start + self.size).reshape(like.shape)

    def write(self, index, value):
        assert index == self.index, "spans are read, then written, in order"
        self.flat = jax.lax.dynamic_update_slice_in_dim(self.flat, value.reshape(-1).astype(self.flat.dtype), self.start, 0)
        # Later readers read the written span: computed again from the old one (XLA fuses the
        # arithmetic into each reader), it would need the old array kept, as a copy.
        return jax.lax.slice_in_dim(self.flat, self.start, self.start + self.size).reshape(value.shape)


# ---------------------------------------------------------------- one step's groups, one program

_RAW = {}  # kind -> (update function, positions of its state arguments): what a batch calls
_batch = None  # the _Batch collecting the update calls of the step running now, or None


class _Batch:
    """The update calls of one optimizer step's parameter groups (torch calls the update once
    per group: nanoGPT and timm split decay and no-decay parameters), run as one program when
    the step ends."""

    def __init__(self):
        self.calls = []  # (kind, in place, arguments, static arguments, finish)
        self.reductions = []  # PendingReductions whose gradients the calls take unreduced

    def run(self):
        if not self.calls:
            return
        plan, donated, kept = [], [], []
        for kind, in_place, args, statics, _ in self.calls:
            positions = ((0,) if in_place else ()) + _RAW[kind][1]
            plan.append((kind, positions, len(args), tuple(sorted(statics.items()))))
            donated.append([arg for i, arg in enumerate(args) if i in positions])
            kept.append([arg for i, arg in enumerate(args) if i not in positions])
        plan = tuple(plan)
        reductions = [reduction for reduction in self.reductions if not reduction.done]
        if reductions:
            results = _reducing(reductions, donated, kept, plan)
        else:
            results = _together(donated, kept, plan)
        for (*_, finish), result in zip(self.calls, results):
            finish(result)


def _reducing(reductions, donated, kept, plan):
    """The batch's program with DDP's average of the gradients first, where every rank takes it
    into its step; else the average alone, then the batch's program."""
    reduction, *others = reductions
    unreduced = _unreduced(reductions)
    for other in others:  # two DDP modules stepped by one optimizer: the first reduces in the step
        other.resolve()
    if not reduction.reducer.agree(True):
        reduction.run_alone()
    if others or reduction.done:
        donated, kept = _averaged(unreduced, (donated, kept))
        if reduction.done:
            return _together(donated, kept, plan)
    values = [root._value for root in reduction.roots]
    places = {id(value): index for index, value in enumerate(values)}
    donated, donated_tree = jax.tree_util.tree_flatten(donated)
    kept, kept_tree = jax.tree_util.tree_flatten(kept)
    where = tuple(places.get(id(leaf), -1) for leaf in donated), tuple(places.get(id(leaf), -1) for leaf in kept)
    program = _reducing_program(plan, donated_tree, kept_tree, where, reduction.reducer.group)
    donated = [leaf for leaf, place in zip(donated, where[0]) if place < 0]
    kept = [leaf for leaf, place in zip(kept, where[1]) if place < 0]
    results, averaged = program(values, donated, kept)
    reduction.finish(averaged, in_step=True)
    return results


@functools.lru_cache(maxsize=16)
def _reducing_program(plan, donated_tree, kept_tree, where, group):
    def put(tree, places, leaves, averaged):
        leaves = iter(leaves)
        return jax.tree_util.tree_unflatten(tree, [next(leaves) if place < 0 else averaged[place] for place in places])

    def body(values, donated, kept):
        averaged = distributed.average(values, group)
        donated = put(donated_tree, where[0], donated, averaged)
        kept = put(kept_tree, where[1], kept, averaged)
        return _updates(donated, kept, plan), averaged

    return distributed.group_program(body, group, donate_argnums=(1,))


def _unreduced(reductions):
    """(array, root) for each gradient the reductions wait on, as it is before they run."""
    return [(root._value, root) for reduction in reductions for root in reduction.roots]


def _averaged(unreduced, tree):
    """`tree` with each of `unreduced`'s arrays that a reduction has since replaced by its average
    replaced the same way (update arguments taken before the reduction ran alone)."""
    now = {id(old): root._value for old, root in unreduced if root._value is not old}
    return jax.tree_util.tree_map(lambda leaf: now.get(id(leaf), leaf), tree) if now else tree


def take_reduction(reduction):
    """Whether the step being batched now takes this reduction into its program (it then takes
    the gradients' values unreduced)."""
    if _batch is None:
        return False
    if reduction not in _batch.reductions:
        _batch.reductions.append(reduction)
    return True


def gradient_values(grads):
    """The values of an update's gradients: unreduced where the batch takes DDP's average of
    them into its program, else as read (which runs any work they wait for)."""
    reduction = PendingReduction.of(grads) if grads else None
    if reduction is not None and not isinstance(root_of(grads[0])._pending, PendingClip) and take_reduction(reduction):
        return [root_of(grad)._value for grad in grads]
    return read_values(grads)


def reductions_waiting():
    """Whether a DDP average waits for a step (the step then batches its updates to take it)."""
    return any(not reduction.done for reduction in _waiting)


_waiting = weakref.WeakSet()


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnums=(0,))
def _together(donated, kept, plan):
    return _updates(donated, kept, plan)


def _updates(donated, kept, plan):
    results = []
    for (kind, positions, count, statics), given, others in zip(plan, donated, kept):
        given, others = iter(given), iter(others)
        args = [next(given) if i in positions else next(others) for i in range(count)]
        results.append(_RAW[kind][0](*args, **dict(statics)))
    return results


@contextlib.contextmanager
def one_program():
    """Within: update calls wait, and run as one program when the block ends (without error)."""
    global _batch
    outer, _batch = _batch, _Batch()
    try:
        yield _batch
        batch, _batch = _batch, outer
        batch.run()
    finally:
        _batch = outer


def batched():
    """The batch collecting update calls now, or None."""
    return _batch


def submit(kind, in_place, args, statics, finish, now=False):
    """Run an update (`kind`: "adam" or "sgd") on `args`, handing its result to `finish`; in a
    `one_program()` block, when the block ends (unless `now`)."""
    if _batch is not None and not now:
        _batch.calls.append((kind, in_place, args, statics, finish))
        return
    if _batch is not None and _batch.reductions:
        # Run now, before the batch: the gradients it took unreduced are averaged first.
        unreduced = _unreduced(_batch.reductions)
        for reduction in _batch.reductions:
            reduction.resolve()
        args = _averaged(unreduced, args)
    plain, with_params = _JITTED[kind]
    finish((with_params if in_place else plain)(*args, **statics))


def _programs(update, static, state):
    """An update's program that reuses the buffers of its state arguments (positions `state`,
    the flat moments), and one that reuses the parameters' too (`in_place`): with each
    parameter's old value no longer needed (runtime.tensor.held_only_by_their_tensors), its
    buffer takes the new value, where a new buffer per parameter costs the host a few
    microseconds to allocate and free on GPUs (ResNet-50: 161 a step)."""
    plain = jax.jit(update, static_argnames=static, donate_argnums=state)
    in_place = jax.jit(update, static_argnames=static, donate_argnums=(0,) + state)
    return plain, in_place


_LAYOUT = ("separate", "max_norm", "norm_type", "flat_shapes", "flat_updated", "joined_grads")
_RAW.update(adam=(adam_update, (2, 3, 4, 8)), sgd=(sgd_update, (2,)))
adam_update, adam_update_in_place = _programs(
    adam_update, ("beta1", "beta2", "eps", "weight_decay", "decoupled", "amsgrad", "maximize", "uniform") + _LAYOUT, (2, 3, 4, 8)
)
sgd_update, sgd_update_in_place = _programs(
    sgd_update, ("momentum", "dampening", "weight_decay", "nesterov", "maximize", "first") + _LAYOUT, (2,)
)
_JITTED = {"adam": (adam_update, adam_update_in_place), "sgd": (sgd_update, sgd_update_in_place)}
