"""Flat roots: tensors that are views into one array, one after another.

An update program's call costs the host a few microseconds for each array it takes and, more, for
each it returns (JAX makes an array object and XLA a buffer for each). An optimizer step over
GPT-2's 148 parameters, their gradients and two moments crossed as ~450 arrays out of the
program, and cost the host more than its kernels took. Here such tensors keep their identity
(torch's optimizer state, a script's references, a module's parameters) and become views into
one flat root each, their `_chain` a slice and a reshape of it (`make_members`):

- the optimizer's state (Adam's moments, SGD's momentum buffers) is made so at its first step
  (`flat_state`);
- the parameters an optimizer step updates are made so once its structure repeats
  (`flat_parameters`): the update takes and returns their root, and a captured region takes the
  root as one input and cuts the parameters out of it inside its program (runtime/capture.py,
  its "packs"), each still a parameter of its own to torch's autograd.

Reading a member whose root changed cuts every member out of the root in one program
(`Members.piece`), and writing one writes its span of the root in place where nothing else
holds the root's array (`write_span`); a member written some other way is scattered into the root
as any view is.
"""

from __future__ import annotations

import functools
import gc
import itertools
import math
import operator
import sys
import weakref

import jax
import jax.numpy as jnp

from . import tensor as tensor_module
from .registry import MAPPINGS, aten
from .tensor import BridgeTensor, read_value
from .views import ViewStep


def split(flat, like):
    """The pieces of a flat array, shaped like the arrays (or shapes) of `like`, one after
    another."""
    pieces, start = [], 0
    for item in like:
        shape = item if isinstance(item, tuple) else item.shape
        size = math.prod(shape)
        pieces.append(flat[start : start + size].reshape(shape))
        start += size
    return pieces


def join(arrays):
    return jnp.concatenate([array.reshape(-1) for array in arrays]) if arrays else jnp.zeros((0,))


join_jit = jax.jit(join)


def merge(chosen, rest, positions, count):
    """`count` values: those of `chosen` at `positions` (in order), those of `rest` at the others."""
    merged, chosen, rest, wanted = [None] * count, iter(chosen), iter(rest), set(positions)
    for i in range(count):
        merged[i] = next(chosen) if i in wanted else next(rest)
    return merged


def _write_span_into(flat, value, start):
    return jax.lax.dynamic_update_slice(flat, value.reshape(-1).astype(flat.dtype), (start,))


_write_span = jax.jit(_write_span_into)
_write_span_donated = jax.jit(_write_span_into, donate_argnums=0)
_split_jit = split_jit = jax.jit(split, static_argnums=1)


class Members:
    """A flat root's members: for each, its span of the root (start, stop, shape), and the
    members' values cut from the root's current value, once one was read (`pieces`). The
    members are known by identity only (held, the root and they would keep each other alive; held
    weakly, torch.utils.swap_tensors, which Module.to uses, refuses to swap them); an alias of
    one (the same chain into the root: a `.grad`, autograd's detach of a member) reads and
    writes as the member (`place`). The layout (spans, chains) is shared by roots of the same
    shapes (_layout)."""

    __slots__ = ("spans", "shapes", "ids", "chains", "index", "by_chain", "span_index", "pieces", "generation")

    def __init__(self, tensors, layout):
        self.spans, self.shapes, self.chains, self.by_chain, self.span_index, _ = layout  # (shared, read only)
        self.ids = tuple(map(id, tensors))
        self.index = {key: position for position, key in enumerate(self.ids)}
        self.pieces = None  # every member's value, cut from the root at `generation`
        self.generation = -1

    def position(self, tensor):
        """The tensor's place among the members, or None for a tensor that is not one."""
        position = self.index.get(id(tensor))
        if position is None or self.by_chain.get(tensor._chain) != self.spans[position]:
            return None  # (another tensor where a member was: ids are reused)
        return position

    def place(self, tensor):
        """The tensor's place among the members, where it is one or an alias of one (the same
        span, by its chain: autograd's detach of a member, which `.grad` holds), else None."""
        position = self.position(tensor)
        if position is None:
            span = self.by_chain.get(tensor._chain)
            position = None if span is None else self.span_index[span]
        return position

    def piece(self, root, value, position):
        """The member's value cut from the root's current `value`: every member is cut in one
        program, the first time one is read after the root changed."""
        if self.pieces is None or self.generation != root._generation:
            self.pieces = list(_split_jit(value, self.shapes))
            self.generation = root._generation
        return self.pieces[position]

    def write(self, root, chain, value):
        """The root's new value with `value` written into the span that `chain` (a member's, or an
        alias's of a member) names, or None for another chain. The root's array is updated in
        place where nothing but the root holds it (load_state_dict's copy into each parameter)."""
        span = self.by_chain.get(chain)
        if span is None:
            return None
        flat = root._value
        # Held by the root's attribute, this frame's name and getrefcount's argument: no one else.
        write = _write_span_donated if sys.getrefcount(flat) <= 3 else _write_span
        return write(flat, value, span[0])

    def written(self, root, chain, value):
        """After `value` was written into the span `chain` names (the root's generation moved on
        by one): the other members' values, cut before, still hold (a loop that reads and writes
        one parameter after another, as LBFGS's or a hand-written update does, cuts them once)."""
        if self.pieces is not None and self.generation == root._generation - 1:
            span = self.by_chain[chain]
            position = self.span_index[span]
            self.pieces[position] = value.reshape(span[2]).astype(self.pieces[position].dtype)
            self.generation = root._generation

    def forget(self):
        """Drop the members' values cut from the root's last value (as large as the root):
        runtime.tensor.write_value calls it when the root itself is written."""
        self.pieces = None


def members_of(root):
    """The root's Members, or None for a root that is not flat."""
    return root.__dict__.get("_members")


def is_member(tensor):
    """Whether the tensor is one of the tensors its flat root was made for."""
    root = tensor._root
    if root is None:
        return False
    members = root.__dict__.get("_members")
    return members is not None and members.position(tensor) is not None


@functools.lru_cache(maxsize=64)
def _layout(shapes, dtype):
    """Members of these shapes, one after another, in a flat root of `dtype`: (spans (start,
    stop, shape), shapes, view chains, chain -> span, span -> position, placeholder values).
    Shared by the roots of one layout (each step's gradients of a parameter group make one)."""
    slice_mapping, view_mapping = MAPPINGS[aten.slice.Tensor], MAPPINGS[aten.view.default]
    start, spans, chains = 0, [], []
    for shape in shapes:
        stop = start + math.prod(shape)
        chains.append((
            ViewStep(slice_mapping, (0, start, stop, 1), {}, None),
            ViewStep(view_mapping, (shape,), {}, None),
        ))
        spans.append((start, stop, shape))
        start = stop
    spans, chains = tuple(spans), tuple(chains)
    by_chain = dict(zip(chains, spans))  # a member's chain -> its span (an alias has the same chain)
    span_index = {span: position for position, span in enumerate(spans)}
    return spans, shapes, chains, by_chain, span_index, tuple(jax.ShapeDtypeStruct(shape, dtype) for shape in shapes)


def make_members(root, tensors, shapes):
    """Make each tensor a view of its span of the flat root, one after another."""
    layout = _layout(tuple(map(tuple, shapes)), root._value.dtype)
    if "_members" in root.__dict__ or any(tensor._root is not None for tensor in tensors):
        tensor_module.root_changed()  # (not for new members of a new root: each backward's gradients)
    for tensor, chain, placeholder in zip(tensors, layout[2], layout[5]):
        tensor._root = root
        tensor._chain = chain
        # Read from the root when first read. The array the tensor held before (the state
        # torch's first step made) must go: kept, it doubled Adam's memory (GPT-2: 0.93 GB).
        tensor._value = placeholder
        tensor._seen = -1
    root._members = Members(tensors, layout)


def flat_state(tensors):
    """The flat root holding `tensors` (state tensors, one per parameter) one after another.

    Made on first use: the tensors keep their identity (the optimizer's state and any
    reference a script holds) and become views into the root, so reading one (state_dict,
    a checkpoint) gives its current value, and writing one writes the root. State replaced
    since (load_state_dict makes new tensors) is gathered into a new root."""
    root = holding(tensors)
    return root if root is not None else _gathered(tensors, [read_value(tensor) for tensor in tensors])


def _gathered(tensors, values):
    """A new flat root holding `values`, the tensors' current values, with the tensors its members."""
    root = BridgeTensor(join_jit(values), tensors[0]._index)
    make_members(root, tensors, [tuple(value.shape) for value in values])
    return root


def holding(tensors):
    """The flat root whose members are exactly `tensors`, in order, or None."""
    root = tensors[0]._root
    if root is None:
        return None
    members = root.__dict__.get("_members")
    if members is None or members.ids != tuple(map(id, tensors)):
        return None
    # (C loops: an optimizer step asks this of its parameters and each state list, 148 tensors each)
    return root if all(map(operator.is_, map(_ROOT, tensors), itertools.repeat(root))) else None


class Holdings:
    """Flat roots found holding lists of tensors (by `flat_state`, `layout` and the like),
    remembered while no tensor's root changed (runtime.tensor.root_changes) and each list has
    the same first tensor and length: for lists that their owner never changes but whole (an
    optimizer update's parameters and state lists). Looking again touches each tensor, which
    for an update's 148 parameters and their state costs more than the update's call."""

    def __init__(self):
        self.found, self.stamp = {}, None

    def get(self, key, tensors, find):
        """find(tensors), or what it returned last for `key` where that still holds."""
        if self.stamp != tensor_module.root_changes:
            self.found, self.stamp = {}, tensor_module.root_changes
        known = self.found.get(key)
        if known is not None and known[0] is tensors[0] and known[1] == len(tensors):
            return known[2]
        result = find(tensors)
        if self.stamp != tensor_module.root_changes:  # (find made a root of them)
            self.found, self.stamp = {}, tensor_module.root_changes
        if result is not None:
            self.found[key] = (tensors[0], len(tensors), result)
        return result


def joined_roots(tensors):
    """Where some of `tensors` are the members (or aliases of them: `.grad`s) of flat roots, each
    member of each root once, in any order: those roots, then the roots of the others (arrays of
    their own, or aliases of whole ones); else None."""
    found, others = {}, []
    for tensor in tensors:
        root = tensor._root
        if root is None or not tensor._chain:
            others.append(tensor if root is None else root)
            continue
        members = root.__dict__.get("_members")
        position = None if members is None else members.place(tensor)
        if position is None:
            return None
        found.setdefault(id(root), (root, members, set()))[2].add(position)
    if not found or sum(len(places) for _, _, places in found.values()) != len(tensors) - len(others):
        return None  # (none joined, or a member twice)
    if any(len(places) != len(members.spans) for _, members, places in found.values()):
        return None
    return [root for root, _, _ in found.values()] + others


def gradient_holders(tensors):
    """Where `tensors` (an update's gradients, in its parameters' order) are, at some places, the
    members (or aliases of them) of one flat root in its order, and at the others arrays of
    their own (or aliases of whole ones): ([that root, then the others' roots], the places of
    its members); else None. (In C loops where it can: an update asks this of GPT-2's 148.)"""
    roots, chains = list(map(_ROOT, tensors)), list(map(_CHAIN, tensors))
    joined = next(itertools.compress(roots, chains), None)  # the first root of a tensor with a chain
    members = None if joined is None else joined.__dict__.get("_members")
    if members is None:
        return None
    # Each tensor with a chain is in the joined root, with a member's chain, in the root's order.
    places = tuple(itertools.compress(range(len(tensors)), map(operator.is_, roots, itertools.repeat(joined))))
    if len(places) != len(tensors) - chains.count(()) or picked(chains, places) != members.chains:
        return None
    holders = [joined]
    if len(places) != len(tensors):
        others = map(operator.is_not, roots, itertools.repeat(joined))
        holders += [tensor if root is None else root for tensor, root in itertools.compress(zip(tensors, roots), others)]
    return holders, places


def picked(values, places):
    """The values at these places, as a tuple."""
    if len(places) == len(values):
        return tuple(values)
    return tuple(operator.itemgetter(*places)(values)) if len(places) > 1 else tuple(values[place] for place in places)


_ROOT = operator.attrgetter("_root")
_CHAIN = operator.attrgetter("_chain")


def layout(tensors):
    """(root, the shapes of all its members, the positions of `tensors` among them or None for
    all) where `tensors` are members of one flat root, in the root's order; else None. An update
    of some of a root's members (the parameters that have gradients this step) takes the whole
    root and passes the others' spans through."""
    root = tensors[0]._root
    members = None if root is None else root.__dict__.get("_members")
    if members is None:
        return None
    if holding(tensors) is root:
        return root, members.shapes, None  # all its members, in order: the usual step
    index, positions, last = members.index, [], -1
    for tensor in tensors:
        position = index.get(id(tensor), -1)
        if tensor._root is not root or position <= last:
            return None
        positions.append(position)
        last = position
    return root, members.shapes, (None if len(positions) == len(members.shapes) else tuple(positions))


def flat_members(flat, like):
    """New tensors, one per tensor of `like`, as views into a new root holding `flat`."""
    root = BridgeTensor(flat, like[0]._index)
    shapes = [tuple(t.shape) for t in like]
    # Placeholders until first read: make_members marks them stale, so a read takes the root.
    index = like[0]._index
    members = [BridgeTensor(placeholder, index) for placeholder in _layout(tuple(shapes), flat.dtype)[5]]
    make_members(root, members, shapes)
    return members


def flat_parameters(params):
    """The flat root holding `params` one after another, made now where it can be, else None.

    A parameter moves into a new root when it owns its array or is an alias of a whole root (a
    parameter after Module.to) or a member of another flat root, its array is on one device, no
    deferred work waits on it, and no other bridge tensor is a view or alias of it or its root
    (that tensor would no longer see the parameter's writes: torch's views share storage).
    Looked for once, when the root is made, among the objects the garbage collector tracks."""
    root = holding(params)
    if root is not None:
        return root
    first = params[0]
    roots = []
    for param in params:
        if param._pending is not None or param._index != first._index or param.dtype != first.dtype:
            return None
        owner = param._root
        if owner is not None and (owner._pending is not None or (param._chain and not is_member(param))):
            return None
        roots.append(param if owner is None else owner)
    values = [read_value(param) for param in params]
    if not all(isinstance(value, jax.Array) and len(value.sharding.device_set) == 1 for value in values):
        return None
    aliased = [id(root) for root in roots if members_of(root) is None]
    if len(set(aliased)) < len(aliased) or _viewed_by_others(params, roots):
        return None  # (two parameters aliasing one root share memory: one span could not hold both)
    root = _gathered(params, values)
    for param, old in zip(params, roots):
        if old is not param and members_of(old) is None:
            # The root a parameter aliased (Module.to's result, a tensor given to nn.Parameter)
            # becomes a view of the same span: a script holding it sees the parameter's values,
            # as torch's shared storage would show them, and its array is let go.
            tensor_module.root_changed()
            old._root, old._chain, old._seen = root, param._chain, -1
            old._value = jax.ShapeDtypeStruct(old._value.shape, old._value.dtype)
    return root


def _viewed_by_others(params, roots):
    """Whether a bridge tensor other than `params` views or aliases one of them or of `roots`
    (a tensor's `_root` in its instance dict). Flat roots among `roots` are not looked at: their
    members move with the parameters, and a view of a member is rooted at the flat root."""
    own = {id(param.__dict__) for param in params}
    watched = [root for root in roots if members_of(root) is None]
    ids = {id(root) for root in watched}
    for referrer in gc.get_referrers(*watched) if watched else ():
        if type(referrer) is dict and id(referrer.get("_root")) in ids and id(referrer) not in own:
            return True
    return False


def gradient_members(value, owners):
    """The gradients of `owners` (parameters that are the members of one flat root, in its
    order) as the members of a new flat root holding `value`, their gradients joined (a fused
    run's, runtime/capture.py): an update of the parameters' whole root then takes one array for
    them. The first write into one of them (an accumulation, `zero_()`, GradScaler's unscale)
    makes each owner's `.grad` a root of its own again (`release`), so that it and the writes
    after it take the way of any gradient instead of a write into the flat array each."""
    members = flat_members(value, owners)
    root = members[0]._root
    owners = [weakref.ref(owner) for owner in owners]
    root._on_member_write = functools.partial(_release_gradients, owners, weakref.ref(root))
    return members


def release_gradients(owners):
    """Each owner's `.grad` that is a member of a flat root of gradients made a root of its own
    again, as the first write into one does (gradient_members)."""
    for owner in owners:
        grad = owner.grad
        root = None if grad is None else grad._root
        release = None if root is None else root.__dict__.get("_on_member_write")
        if release is not None:
            release()


def _release_gradients(owners, reference):
    root = reference()
    root.__dict__.pop("_on_member_write", None)
    grads = []
    for reference in owners:
        owner = reference()
        grad = None if owner is None else owner.grad
        if grad is not None and grad._root is root:
            grads.append(grad)
    # Held by the gradients, the caller's name, this frame's and getrefcount's argument: nothing
    # else views the root (a view of a `.grad`, a script's alias). Where something does, the
    # gradients stay in the root and each write goes into its span, so that the view sees it,
    # as torch's shared storage would show it.
    if sys.getrefcount(root) <= len(grads) + 3:
        release(grads)


def release(tensors):
    """Each member among `tensors` (or alias of one) made a root of its own again, with its
    current value (one program cuts them all): for an update that takes its parameters one by
    one, which would otherwise write each into its flat root's span."""
    for tensor in tensors:
        root = tensor._root
        members = None if root is None else members_of(root)
        if members is not None and members.place(tensor) is not None:
            value = read_value(tensor)
            tensor_module.root_changed()
            tensor._root, tensor._chain, tensor._value = None, (), value
            tensor._seen = 0
            tensor._generation += 1
