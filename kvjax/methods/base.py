"""The cache-method interface (as code) and the slot cache most methods share.

A method is a frozen, hashable config dataclass (static under ``jit``) that subclasses :class:`Method` and
implements four pure functions over its own state pytree (docs/interface.md#the-method-interface):

- ``init(model_cfg, batch, capacity, layer, dtype) -> State``: fixed shapes from :class:`Capacity` (prompt
  bucket and ``max_new_tokens``); ``layer`` lets a method vary per layer (PyramidKV, outlier heads).
- ``prefill(state, layer, q [B,Hq,T,D], k [B,Hkv,T,D], v [B,Hkv,T,D], lengths [B], previous=None) -> State``:
  store / compress the prompt's KV. ``previous`` is the state the previous layer's ``prefill`` returned, passed
  only to methods that declare ``reuses_previous_layer`` (ChunkKV's index reuse; None at layer 0).
- ``decode(state, layer, q [B,Hq,D], k [B,Hkv,D], v [B,Hkv,D], pos [B]) -> (out [B,Hq,D] f32, State)``: store
  the new token, attend, evict / re-compress; all at fixed shapes.
- ``memory_bytes(state) -> int``: bytes the state really holds (every leaf, counts and positions included).

Four optional capabilities are types a method inherits, whose abstract functions are the capability
(:class:`AttendsPrompt`: ``prefill_attend``; :class:`DecodePartial`: ``decode_partial``, the attention partials
and the KV pair evicted this step, which LESS wraps; :class:`Recompressible`: ``rescorer``, ``reselect``,
``observation_window``, for a decode budget; :class:`Recalls`: ``selected_positions`` and ``attended``): a class
that inherits one and does not implement it cannot be instantiated. The flags the engine, eval and LESS read
(``attends_prompt``, ``has_decode_partial``, ``recompressible``, ``recalls``; never ``getattr``) are derived
from the type (:data:`CAPABILITIES`); only LESS's ``attends_prompt`` is decided per instance (its policy's).
The other declarations are here with their defaults:

- ``reuses_previous_layer`` (ClassVar bool, default False): prefill takes ``previous=``.
- ``bytes_read_per_step(state, num_heads) -> int``: the bytes one decode step of this layer reads (K/V blocks
  the decode-attention kernel's block plan visits, masks, codes, ...), beside ``memory_bytes``.
- ``state_axes(state)``: the logical axes of each state leaf, for sharding (:mod:`kvjax.sharding`): by default a
  leaf is batch-major and head-major, ``[B]`` -> ``("batch",)`` and ``[B, Hkv, ...]`` -> ``("batch",
  "kv_heads")``; a method overrides it for leaves that are not (LESS's learned kernels are replicated).
- ``held_overhead_bytes(model_cfg, batch, capacity, layer, dtype) -> int``: the bytes one layer's state may hold
  beyond ``b`` x what ``full`` holds at ``capacity`` (``b``: the budget as a fraction of a prompt that fills the
  bucket): by default a slot cache's ``max_new_tokens`` decode slots and one slot of rounding; methods add what
  else they keep (H2O's scores, Chelsea's merge interval and counts, LESS's constant-size state and kernels). The
  recall methods keep everything: full's bytes plus their index (codes, centroids, page bounds). The compiled
  ``init`` + ``prefill`` program's output is checked against it (tests/kvjax/test_measured.py).
- ``tokens_held(state) -> [B] float32``: tokens each sequence holds now (mean over KV heads).
- ``held(n, steps, ctx=LayerContext()) -> int``: the budget contract on the host: the most tokens (per KV head,
  mean over the layer's KV heads) a sequence with an ``n``-token prompt holds after ``steps`` decode steps, at the
  layer and cache :class:`LayerContext` names (PyramidKV's budget depends on the layer, Chelsea's on the
  ``max_new_tokens`` to come and the model's outlier heads). The budget table of
  docs/interface.md#the-budget-contract is this function.
- ``at(layer) -> Method``: the method that runs layer ``layer`` (a static int), by default the method itself
  (ClusterKV's and Quest's ``full`` below their ``n_full``). A per-layer plan
  (:class:`~kvjax.methods.plans.layers.PerLayerPlan`: ``FullFirst``, ``Hybrid``) is not a method but answers ``at`` too,
  and every caller that builds, runs or measures a layer's state (the engine, eval, the benchmarks) takes either
  and asks ``m.at(layer)`` first, so no method dispatches on its state's type; what names either is
  :func:`kvjax.methods.plans.layers.method_of`'s.
- ``traced_layer`` (ClassVar bool, default False): ``prefill``/``decode`` work with ``layer`` a traced int32
  scalar over a run of layers whose ``init`` states agree, so the engine can scan over those layers (one compiled
  layer body instead of ``L``; ``kvjax.load_model(..., scan_layers=True)``). Every built-in method declares it.
- ``recompresses`` (ClassVar bool, default False): some decode steps re-compress the whole cache (Chelsea's
  rounds), so those steps compute over every slot of the layer.

Budgets (:mod:`kvjax.budget`): a float ``b`` in ``(0, 1]`` gives each sequence ``ceil(b n)`` tokens of its own
prompt ``n`` (exact integers), an int is a token count. A method never holds more than its budget; on a prompt
too short for its window, sinks or chunk it shrinks them (most recent tokens first) instead of overshooting or
raising. Static slot counts come from the bucket (the largest ``n`` it can hold); what a sequence keeps comes
from its own ``n`` only, so the same prompt in any bucket keeps the same tokens.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import inspect
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from kernels_pallas.decode_attention import block_plan_bytes
from kvjax.model import attention
from kvjax.budget import MIN_TOKENS, budget_tokens, check_budget  # noqa: F401  (re-exported for the methods)
from kvjax.config import ModelConfig
from kvjax.methods import boundary
from kvjax import sharding
from kvjax.sharding import BATCH, KV_HEADS, SLOTS


#: The recall methods' :attr:`Method.why_no_decode_budget`.
RECALL_NO_DECODE_BUDGET = (
    "The recall methods (pqcache, clusterkv, quest) keep every token by design and bound what a step reads (their "
    "budget), not what is held."
)


@dataclasses.dataclass(frozen=True)
class Capacity:
    """Static sizes a cache is built for: the padded prompt length (bucket) and the decode steps."""

    prompt_len: int
    max_new_tokens: int


@dataclasses.dataclass(frozen=True)
class LayerContext:
    """Where a :meth:`Method.held` count applies: layer ``layer`` of ``num_layers``, a cache built for ``capacity``
    (None: Chelsea's ``Gamma`` is the ``steps`` asked about) of a model ``model_cfg`` (None: no outlier heads)."""

    layer: int = 0
    num_layers: int = 1
    capacity: Capacity | None = None
    model_cfg: ModelConfig | None = None


def _typed(value):
    """``value`` with its type beside it (tuples and lists element by element), so that ``1`` and ``1.0`` differ."""
    if isinstance(value, (tuple, list)):
        return type(value), tuple(_typed(x) for x in value)
    return type(value), value


class StaticConfig:
    """A frozen config dataclass that is a static ``jit`` argument: it compares and hashes by its class and its typed
    field values (:meth:`__eq__`), so subclasses are declared with ``eq=False``. :class:`Method` and the per-layer
    plans (:class:`kvjax.methods.plans.layers.PerLayerPlan`) are ones."""

    @functools.cached_property
    def _key(self) -> tuple:
        """The class and the typed field values, computed once (the fields are frozen): ``jax.jit`` hashes and
        compares a static method on every dispatch, which the python driver does once per decode step."""
        return type(self), tuple((f.name, _typed(getattr(self, f.name))) for f in dataclasses.fields(self))

    def __eq__(self, other) -> bool:
        """Equal when of one class with the same field values *of the same types*: ``budget=1`` (one token) and
        ``budget=1.0`` (the whole prompt) are equal in Python but different methods. ``jax.jit`` keys its
        compiled programs on a static method by this, so the dataclass default (``1 == 1.0``) ran the program
        compiled for one budget for the other."""
        return self is other or (isinstance(other, StaticConfig) and self._key == other._key)

    def __hash__(self) -> int:
        return hash(self._key)


class Budgeted(abc.ABC):
    """The budget contract of a method (docs/interface.md#the-budget-contract), on the host: its budget, how many
    tokens a sequence holds (:meth:`held`, abstract) and how the budget reads (the smallest legal and sensible
    ones, the tokens it gives a prompt, whether it covers everything). A part of :class:`Method`."""

    #: The budget (a fraction of the prompt, or a token count; docs/interface.md#the-budget-contract); None for a
    #: method without one (``full``). A method with a budget declares it as a dataclass field and validates it once,
    #: in its ``__post_init__``.
    budget: ClassVar[float | int | None] = None
    #: Every sequence holds exactly :meth:`held` tokens; False: at most that many (ChunkKV, whose chunk that
    #: straddles the window is cut there).
    holds_exactly: ClassVar[bool] = True
    #: Why a decode budget (:class:`~kvjax.methods.core.bounded.DecodeBudget`) does not compose over a method that is
    #: not ``recompressible``: how it bounds decode already, or why it keeps every token. The ValueError refusing
    #: ``methods.get(name, ..., decode_budget=N)`` ends with it. Default: nothing to add.
    why_no_decode_budget: ClassVar[str] = ""

    def min_legal_budget(self) -> int:
        """The smallest token-count budget this configuration accepts (a smaller one is a ValueError): 1, or one
        page (Quest), the sinks (ClusterKV). Not :meth:`min_budget`, the smallest one that is sensible."""
        return 1

    def min_budget(self) -> tuple[int, str]:
        """``(tokens, why)``: the fewest tokens this method's budget can use sensibly (its sinks + window, a chunk,
        a page; at least :data:`kvjax.budget.MIN_TOKENS`) and a few words on why. A smaller budget still runs (the
        method shrinks its windows, docs/interface.md#the-budget-contract) but :func:`kvjax.budget.
        warn_small_budget` warns once."""
        return MIN_TOKENS, f"a budget of 1-{MIN_TOKENS - 1} tokens keeps no usable context"

    def attends_everything(self, model_cfg: ModelConfig, capacity: Capacity, layer: int = 0) -> bool:
        """Whether, in a cache built for ``capacity``, this layer's decode steps attend every token of a prompt that
        fills the bucket and of every generated token, i.e. compute exactly full attention: too few tokens to
        compress (a recall budget that covers them all, a prompt too short for PQ retrieval, no merge round of
        Chelsea). :func:`kvjax.budget.warn_full_attention` says so once. Default: ``False``."""
        return False

    def kept_tokens(self, n: int, max_new_tokens: int = 0, model_cfg: ModelConfig | None = None) -> int:
        """Tokens the budget gives a sequence with an ``n``-token prompt (host ints): ``budget_tokens(budget, n)``
        (Chelsea's budget also counts the ``max_new_tokens`` to come). Compared with :meth:`min_budget`."""
        return int(budget_tokens(self.budget, n))

    @abc.abstractmethod
    def held(self, n: int, steps: int, ctx: LayerContext = LayerContext()) -> int: ...


class Accounted(abc.ABC):
    """The byte and token accounting of a method's state, on the host, outside ``jit`` (the engine's statistics and
    the tests ask these, never the state's shapes): the bytes it holds, those one decode step reads, the tokens each
    sequence holds, its index and what it may hold beyond its share of the prompt. A part of :class:`Method`;
    :class:`SlotMethod` derives the abstract ones for a slot cache."""

    def memory_bytes(self, state) -> int:
        """Bytes of every leaf of the state (override when part of it is not cache, e.g. LESS's kernels)."""
        return tree_bytes(state)

    @abc.abstractmethod
    def bytes_read_per_step(self, state, num_heads: int) -> int: ...

    def held_overhead_bytes(self, model_cfg: ModelConfig, batch: int, capacity: Capacity, layer: int, dtype) -> int:
        """Bytes layer ``layer``'s state may hold beyond ``b`` x full's at ``capacity`` (module docstring). Default,
        a slot cache: ``max_new_tokens`` decode slots and one slot of rounding (``ceil(b n)``), K, V and position."""
        return (capacity.max_new_tokens + 1) * slot_bytes(model_cfg, batch, dtype)

    @abc.abstractmethod
    def tokens_held(self, state) -> jnp.ndarray: ...

    def index_bytes(self, state, n=None, steps=None) -> tuple[int, Any]:
        """``(allocated, live)``: the bytes of this layer's state that are sized by the bucket but grow with the
        tokens a sequence holds besides its per-slot leaves (Quest's page bounds, PQCache's codes, ClusterKV's
        centroids), for the whole batch, and those each sequence uses now (``[B]``). ``n``, ``steps`` None: measured
        on a concrete state (its fill counts); else from the state's shapes for prompts ``n`` (an int array) after
        ``steps`` decode steps. :func:`kvjax.engine.held_bytes` and ``expected_held_bytes`` count the live part
        instead of the allocated one, so held bytes follow the sequence, not the bucket. Default: none, ``(0, 0)``."""
        return 0, 0


class Method(StaticConfig, Budgeted, Accounted, abc.ABC):
    """The interface every cache method implements (see the module docstring): its core is what it computes
    (``init``, ``prefill``, ``decode``) and what the engine needs to lay out and run its state (``at``,
    ``starts_at``, ``state_axes``, ``offloads``, ``traced_layer``, ``reuses_previous_layer``, ``step_kernels``,
    ``recompresses``); the budget contract is :class:`Budgeted`'s, the accounting :class:`Accounted`'s, and each
    optional capability a type of its own (:data:`CAPABILITIES`). Subclasses are frozen dataclasses declared with
    ``eq=False`` (the registry sets it for a plugin's), so that they compare and hash as a :class:`StaticConfig`;
    ``name`` is the registry name. A per-layer plan (:class:`kvjax.methods.plans.layers.PerLayerPlan`) is not a
    method: it answers :meth:`at` only."""

    def __init_subclass__(cls, **kwargs):
        """Put the boundary checks (:mod:`kvjax.methods.boundary`) in front of the ``init``, ``prefill``,
        ``prefill_attend``, ``decode`` and ``decode_partial`` the subclass defines: every method, a plugin's
        included, raises the same ValueError for arguments of the wrong shape, at trace time."""
        super().__init_subclass__(**kwargs)
        for name in boundary.WRAPPED:
            if name in cls.__dict__:
                setattr(cls, name, boundary.checked(name, cls.__dict__[name]))
        for flag, capability in CAPABILITIES.items():
            declared = inspect.getattr_static(cls, flag)
            if isinstance(declared, property):  # decided per instance (LESS's attends_prompt is its policy's)
                continue
            if flag in cls.__dict__:
                raise TypeError(
                    f"{cls.__name__} sets {flag}: a capability is declared by inheriting "
                    f"kvjax.methods.base.{capability.__name__} (and implementing its functions), not by a flag"
                )
            setattr(cls, flag, issubclass(cls, capability))

    name: ClassVar[str] = ""
    #: ChunkKV-style index reuse: ``prefill`` gets ``previous=`` (the previous layer's prefill state).
    reuses_previous_layer: ClassVar[bool] = False
    #: ``prefill``/``decode`` accept ``layer`` as a traced int32 scalar when called on a run of layers whose states
    #: agree (the engine's scan over layers, ``init_states(..., scan_layers=True)``): nothing branches on it in
    #: Python. Per-layer differences live in ``init`` (shapes, static fields, per-layer arrays in the state).
    traced_layer: ClassVar[bool] = False
    #: The Pallas kernels (``kernels_pallas``) a decode step calls on an accelerator, sorted: the decode attention
    #: for most; a method with kernels of its own besides it takes an ``impl`` option for them (Chelsea, PQCache,
    #: ClusterKV); none for a step that attends on its XLA path (H2O, LESS: the weights come with the scores).
    #: The export and accelerator tests check the compiled step holds exactly these.
    step_kernels: ClassVar[tuple[str, ...]] = ("decode_attention",)
    #: Some decode steps re-compress the whole cache (Chelsea's merge round every ``interval`` steps): those steps
    #: compute over every slot of the layer's K/V, not only through the decode attention's chunks. The scan test
    #: (tests/kvjax/test_scan_layers.py) allows such whole-layer values, but still no copy of the stack.
    recompresses: ClassVar[bool] = False

    #: The capabilities' flags, derived from the type (:data:`CAPABILITIES`; set by :meth:`__init_subclass__`): a
    #: method inherits :class:`AttendsPrompt`, :class:`DecodePartial`, :class:`Recompressible` or :class:`Recalls`,
    #: and never sets these.
    attends_prompt: ClassVar[bool] = False
    has_decode_partial: ClassVar[bool] = False
    recompressible: ClassVar[bool] = False
    recalls: ClassVar[bool] = False

    def starts_at(self, layer: int) -> bool:
        """Whether ``layer`` can be the first layer this method runs (a per-layer plan's first layer after its full
        ones): False where the layer reuses an earlier layer's selection (ChunkKV's followers)."""
        return True

    def at(self, layer: int) -> "Method":
        """The method that runs layer ``layer`` (a static int): this one (ClusterKV's and Quest's: ``full`` below
        their ``n_full``). Callers resolve it before ``init``, ``prefill``, ``decode`` and every per-state measure,
        as they resolve a per-layer plan's (module docstring)."""
        return self

    @abc.abstractmethod
    def init(self, model_cfg: ModelConfig, batch: int, capacity: Capacity, layer: int, dtype) -> Any: ...

    @abc.abstractmethod
    def prefill(self, state, layer: int, q, k, v, lengths, previous=None): ...

    @abc.abstractmethod
    def decode(self, state, layer: int, q, k, v, pos): ...

    @property
    def offloads(self) -> bool:
        """Whether the state keeps its K/V in one device's host memory (``pinned_host``), which a mesh cannot split
        (PQCache's and ClusterKV's ``offload=True``); the engine refuses such a method with a mesh."""
        return False

    def state_axes(self, state) -> Any:
        """The logical axes of each leaf of ``state`` (a pytree of tuples like ``state``): scalars ``()``, ``[B]``
        leaves ``("batch",)``, ``[B, Hkv, ...]`` leaves ``("batch", "kv_heads")`` (head-major, the layout every
        method keeps). :mod:`kvjax.sharding` maps ``batch`` to the mesh axis ``data`` and ``kv_heads`` to ``model``;
        override for leaves without a batch axis (they are then replicated). The leaves of the slot buffer, whose
        slots hold the tokens the method keeps (K, V and per-slot metadata: ``[B, Hkv, S, ...]``), declare their
        third axis ``slots`` (:func:`slot_axes`): :mod:`kvjax.engine.accounting` charges each held token one slot of
        them and counts the rest of the state as fixed. A :class:`SlotCache` declares its own."""
        if isinstance(state, SlotCache):
            return slot_axes(state, "k", "v", "pos", "score")
        return jax.tree.map(lambda x: default_axes(x.ndim), state)


# ---------------------------------------------------------------------------------------------------------------
# The optional capabilities, each a type a method inherits: its abstract functions are the capability, so a class
# that declares one and does not implement it cannot be instantiated (TypeError), and the flag the engine reads
# (``attends_prompt``, ``has_decode_partial``, ``recompressible``, ``recalls``) is derived from the type.


class AttendsPrompt(abc.ABC):
    """The method computes the prompt's causal attention together with its own prefill (H2O's accumulated scores
    come from the attention's probabilities), and the engine takes that output instead of running the prefill
    attention a second time (on layers without a sliding window, where the engine's prefill attention is the
    pure-JAX one). Flag: ``attends_prompt``."""

    @abc.abstractmethod
    def prefill_attend(self, state, layer: int, q, k, v, lengths, previous=None):
        """``(out [B, Hq, T, D] in q.dtype, new state)``: the prompt's causal attention (as
        ``kvjax.model.causal_attention(q, k, v, lengths)``) and :meth:`prefill`'s state, from one pass."""


class DecodePartial(abc.ABC):
    """A decode step that returns its attention partials and the KV pair it evicted, which LESS wraps (h2o,
    streaming_llm). Flag: ``has_decode_partial``."""

    @abc.abstractmethod
    def decode_partial(self, state, layer: int, q, k, v, pos):
        """``((o, m, l), State, (k_ev [B, Hkv, D], v_ev [B, Hkv, D], evicted [B, Hkv] bool))``."""


class Recompressible(abc.ABC):
    """A decode budget composes over it (:class:`kvjax.methods.core.bounded.DecodeBudget`, ``methods.get(name, ...,
    decode_budget=N, every=E)``): its state is a :class:`SlotCache` whose ``decode`` appends after the kept prompt
    (:class:`SlotMethod`'s), and its own scoring and selection are re-applied to the slots it holds. Flag:
    ``recompressible``."""

    @abc.abstractmethod
    def rescorer(self):
        """The :class:`~kvjax.methods.core.scorers.Scorer` a decode-time re-compression ranks the held slots with (its
        ``observed`` votes from the recent queries, then ``finish``)."""

    @abc.abstractmethod
    def reselect(self, votes, lengths, budgets, slots: int):
        """The method's own selection over a held sequence: ``votes [N, H, S]`` raw scores of slots in position
        order (:meth:`rescorer`'s ``observed``; ``finish`` is the method's to apply), ``lengths [N]`` the slots
        held, ``budgets [N]`` the tokens to keep (window included), ``slots`` the static output size. Returns
        ``(idx [N, H, slots] int32, ok [N, H, slots] bool)``, indices into ``S``, real entries first, in order;
        every slot when ``lengths <= budgets``."""

    @abc.abstractmethod
    def observation_window(self) -> int:
        """How many recent queries a decode-time re-compression scores with (SnapKV's and ChunkKV's ``window``)."""

    def head_votes(self, votes):
        """``votes [B, H, S]`` of the held slots (position order) as the heads rank them: unchanged, each KV head its
        own (the default); a method whose heads share one selection averages them (ChunkKV ``head_mode="shared"``).
        Applied before :meth:`reselect`, which sees the heads one at a time."""
        return votes

    def decode_target(self, decode_budget: int, layer: int, num_layers: int) -> int:
        """Tokens layer ``layer`` keeps after a decode-time re-compression under ``decode_budget`` (a count):
        the budget itself; PyramidKV splits it over the layers as it splits its prompt budget."""
        return decode_budget


class Recalls(abc.ABC):
    """A recall method (PQCache, ClusterKV, Quest): every token stays stored and each decode step attends a
    query-dependent selection. ``kvjax-eval fidelity`` compares :meth:`selected_positions` with the exact top-B
    attention tokens (ClusterKV Fig. 11's recall). Flag: ``recalls``."""

    @abc.abstractmethod
    def selected_positions(self, state, layer: int, q) -> jnp.ndarray:
        """``[B, Hq, S]`` bool: the token positions ``[0, S)`` the next decode step (the one whose new token goes at
        position ``filled``) would attend for ``q [B, Hq, D]``, the new token itself excluded (sinks, windows, pages,
        clusters, retrieved tokens included)."""

    @abc.abstractmethod
    def attended(self, n: int, steps: int, ctx: LayerContext = LayerContext()) -> int:
        """How many tokens the decode step after ``steps`` steps attends for an ``n``-token prompt, the new token
        included (:meth:`Method.held`'s arguments)."""


#: Each capability's flag on :class:`Method` and the type that declares it.
CAPABILITIES: dict[str, type] = {
    "attends_prompt": AttendsPrompt,
    "has_decode_partial": DecodePartial,
    "recompressible": Recompressible,
    "recalls": Recalls,
}


def attends_all_steps(method, model_cfg: ModelConfig, capacity: Capacity, layer: int = 0) -> bool:
    """:meth:`Method.attends_everything` of a recall method from its ``attended(n, steps, ctx)`` count: a prompt
    of ``n = capacity.prompt_len`` tokens attends ``n + steps + 1`` tokens at every decode step."""
    n, new = capacity.prompt_len, capacity.max_new_tokens
    ctx = LayerContext(layer, model_cfg.num_layers, capacity, model_cfg)
    return all(method.attended(n, s, ctx) >= n + s + 1 for s in range(max(new, 1)))


# ---------------------------------------------------------------------------------------------------------------
# The slot cache shared by full, streaming_llm, h2o, snapkv, pyramidkv, chunkkv (and LESS's sparse part).


class SlotMethod(Method):
    """A method whose state is a :class:`SlotCache` (kept prompt tokens, then the generated ones after them): its
    ``decode`` appends the new token after the kept prompt and attends the live slots (:func:`append_decode`),
    ``bytes_read_per_step`` counts the decode-attention kernel's block plan over the live slots
    (:func:`slot_bytes_read`) and ``tokens_held`` the valid slots (:func:`slot_tokens_held`). A slot-cache method
    writes ``init``, ``prefill`` and ``held`` and overrides what differs (an evicting ``decode``, extra bytes read)."""

    def decode(self, state: "SlotCache", layer: int, q, k, v, pos):
        return append_decode(state, q, k, v, pos)

    def bytes_read_per_step(self, state: "SlotCache", num_heads: int) -> int:
        return slot_bytes_read(state, num_heads)

    def tokens_held(self, state: "SlotCache"):
        return slot_tokens_held(state)


@struct.dataclass
class SlotCache:
    """Head-major slot buffers with a per-sequence fill count.

    k, v: ``[B, Hkv, S, D]``; pos: ``[B, Hkv, S]`` int32 original position of each slot, -1 when empty;
    score: ``[B, Hkv, S]`` float32 accumulated attention (H2O) or ``[B, Hkv, 0]``; length: ``[B]`` int32, the
    slots ``[0, length)`` of a sequence are the only ones that can be live (decode attention reads only them;
    appends go at ``length``); limit: ``[B]`` int32 tokens the sequence may hold during decode (evicting
    methods), or its kept-prompt count. Static: prompt_slots (slots reserved for the compressed prompt at this
    bucket) and num_layers.
    """

    k: jnp.ndarray
    v: jnp.ndarray
    pos: jnp.ndarray
    score: jnp.ndarray
    length: jnp.ndarray
    limit: jnp.ndarray
    prompt_slots: int = struct.field(pytree_node=False, default=0)
    num_layers: int = struct.field(pytree_node=False, default=0)

    @property
    def valid(self) -> jnp.ndarray:
        return self.pos >= 0


def empty_slots(
    model_cfg: ModelConfig, batch: int, slots: int, dtype, prompt_slots: int, with_score: bool = False
) -> SlotCache:
    """An empty cache of ``slots`` slots whose first ``prompt_slots`` can hold the prompt."""
    h, d = model_cfg.num_kv_heads, model_cfg.head_dim
    return SlotCache(
        k=jnp.zeros((batch, h, slots, d), dtype),
        v=jnp.zeros((batch, h, slots, d), dtype),
        pos=jnp.full((batch, h, slots), -1, jnp.int32),
        score=jnp.zeros((batch, h, slots if with_score else 0), jnp.float32),
        length=jnp.zeros((batch,), jnp.int32),
        limit=jnp.zeros((batch,), jnp.int32),
        prompt_slots=prompt_slots,
        num_layers=model_cfg.num_layers,
    )


def store_prompt(state: SlotCache, k, v, idx, ok, score=None, limit=None) -> SlotCache:
    """Gather prompt tokens ``idx [B,Hkv,P]`` (``ok`` marks real ones, real entries first) into slots ``[0, P)``;
    the fill count becomes the most real entries of any head. ``limit [B]`` defaults to that count."""
    p = idx.shape[-1]
    safe = jnp.clip(idx, 0, k.shape[2] - 1)
    kk = jnp.take_along_axis(k, safe[..., None], axis=2).astype(state.k.dtype)
    vv = jnp.take_along_axis(v, safe[..., None], axis=2).astype(state.v.dtype)
    pos = jnp.where(ok, idx, -1).astype(jnp.int32)
    filled = jnp.max(jnp.where(ok, jnp.arange(p) + 1, 0), axis=(1, 2)).astype(jnp.int32)  # [B]
    new = state.replace(
        k=state.k.at[:, :, :p].set(kk),
        v=state.v.at[:, :, :p].set(vv),
        pos=state.pos.at[:, :, :p].set(pos),
        length=filled,
        limit=filled if limit is None else limit.astype(jnp.int32),
    )
    if score is not None and state.score.shape[-1]:
        sc = jnp.where(ok, jnp.take_along_axis(score, safe, axis=2), 0.0)
        new = new.replace(score=new.score.at[:, :, :p].set(sc))
    return new


def write_token(state: SlotCache, slot: jnp.ndarray, k, v, pos) -> SlotCache:
    """Write the new token ``k, v [B,Hkv,D]`` at position ``pos [B]`` into ``slot [B,Hkv]`` (in place); the fill
    count grows to cover it."""
    return state.replace(
        k=rows_at(state.k, slot, k),
        v=rows_at(state.v, slot, v),
        pos=rows_at(state.pos, slot, pos[:, None]),
        length=jnp.maximum(state.length, jnp.max(slot, axis=1) + 1).astype(jnp.int32),
    )


def rows_at(buf: jnp.ndarray, idx: jnp.ndarray, x, op: str = "set") -> jnp.ndarray:
    """``buf[b, h].at[idx[b, h]].<op>(x[b, h])`` for every sequence ``b`` and head ``h`` (``op``: ``"set"``,
    ``"add"``, ``"max"``, ...; out-of-range indices are dropped, as ``.at`` does). ``buf [B, H, S, ...]``; ``idx
    [B, H]`` (one slot) or ``[B, H, K]``; ``x`` broadcastable to ``buf[b, h][idx[b, h]]`` per row.

    Vmapped over ``(b, h)`` so the scatter keeps batch and head as batching dimensions: a buffer split over them
    (:mod:`kvjax.sharding`) is updated where it lives. Fancy indexing with ``arange`` index arrays
    (``buf.at[bi, hi, idx]``) made XLA all-gather the indices and updates, or the whole buffer."""
    x = jnp.broadcast_to(jnp.asarray(x).astype(buf.dtype), idx.shape + buf.shape[3:])
    one = lambda row, i, val: getattr(row.at[i], op)(val, mode="drop")
    return jax.vmap(jax.vmap(one))(buf, idx, x)


def top_k(x: jnp.ndarray, k: int):
    """``jax.lax.top_k(x, k)`` of a batch-major, head-major ``x [B, H, ..., N]``, split per (sequence, head) on a
    mesh (:func:`kvjax.sharding.per_head`: XLA's partitioner gathers a ``top_k`` operand whole otherwise)."""
    return sharding.per_head(lambda y: jax.lax.top_k(y, k), x)


def evicting_budget(budget, n, most):
    """Tokens a sequence of an evicting method (``streaming_llm``, ``h2o``, LESS's policies) may hold: a fraction
    gives ``ceil(b n)`` of its own ``n``-token prompt; a count ``c`` also covers generated tokens, ``min(c,
    most)`` with ``most`` the most tokens the sequence can reach (``n + new tokens``, or the static slots).
    ``n``, ``most``: ints or ``[B]`` arrays."""
    return budget_tokens(budget, n, n if isinstance(budget, float) else most)


def attend_slots(state: SlotCache, q, bias=None):
    """Partials ``(o, m, l)`` of ``q [B,Hq,D]`` over the live slots: the kernel reads only ``[0, length)``."""
    return attention.attend(q, state.k, state.v, state.valid, bias=bias, lengths=state.length)


def append_decode(state: SlotCache, q, k, v, pos):
    """Decode for methods that keep the compressed prompt and append every new token right after it."""
    b, h = k.shape[:2]
    slot = jnp.broadcast_to(state.length[:, None], (b, h))
    state = write_token(state, slot, k, v, pos)
    return attention.normalise(attend_slots(state, q)), state


def slot_bytes_read(state: SlotCache, num_heads: int, extra_per_slot: int = 0) -> int:
    """Bytes one decode step reads from a slot cache: the K/V blocks the decode-attention kernel's block plan
    visits for ``[0, length)`` plus the valid mask (float32 per visited slot), the query and the output; plus
    ``extra_per_slot`` bytes per live slot (e.g. H2O's scores, read and written)."""
    live = int(jnp.sum(state.length)) * state.k.shape[1]
    return block_plan_bytes(state.k, state.length, num_heads=num_heads, with_mask=True) + live * extra_per_slot


def slot_bytes(model_cfg: ModelConfig, batch: int, dtype, extra: int = 4) -> int:
    """Bytes of one slot of every sequence and KV head: its K and V rows plus ``extra`` bytes (an int32 position)."""
    return batch * model_cfg.num_kv_heads * (2 * model_cfg.head_dim * jnp.dtype(dtype).itemsize + extra)


def full_bytes(model_cfg: ModelConfig, batch: int, capacity: Capacity, dtype) -> int:
    """Bytes one layer of ``full`` holds at ``capacity``: every prompt and decode slot, plus ``length``, ``limit``."""
    return (capacity.prompt_len + capacity.max_new_tokens) * slot_bytes(model_cfg, batch, dtype) + 8 * batch


def slot_tokens_held(state: SlotCache) -> jnp.ndarray:
    """``[B]`` float32: valid slots per sequence, mean over KV heads."""
    return jnp.mean(jnp.sum(state.valid, axis=-1), axis=-1).astype(jnp.float32)


def default_axes(ndim: int) -> tuple:
    """Logical axes of a batch-major, head-major state leaf of ``ndim`` dimensions (see ``Method.state_axes``)."""
    return ((), (BATCH,))[ndim] if ndim < 2 else (BATCH, KV_HEADS)


def slot_axes(state, *fields: str):
    """``state``'s logical axes (:func:`default_axes` per leaf) with the leaves ``fields`` (``[B, Hkv, S, ...]``)
    declared the slot buffer: ``("batch", "kv_heads", "slots")`` (``Method.state_axes``)."""
    axes = jax.tree.map(lambda x: default_axes(x.ndim), state)
    return axes.replace(**{f: (BATCH, KV_HEADS, SLOTS) for f in fields})


def tree_bytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def sum_small_axis(x: jnp.ndarray, axis: int) -> jnp.ndarray:
    """``x.sum(axis)`` for a short, non-minor ``axis`` (a GQA group), as a chain of adds over its slices. XLA:CPU
    lowers a reduction over a middle axis fused with its operand (``(e / t).sum(axis=2)`` of ``[1, 8, 4, 4096]``)
    to a kernel 20-60x slower than the adds (1.5 ms against 30 us; ``[1, 8, 4, 32768]``: 5 ms against 0.08 ms).
    Not a rule: inside H2O's chunk loop the reduce was the faster (A/B at 32k), so use it where measured."""
    parts = [jax.lax.index_in_dim(x, i, axis, keepdims=False) for i in range(x.shape[axis])]
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out


def check_registrable(cls, base: type, base_path: str, registry: dict, register: str, kind: str) -> None:
    """The checks :func:`kvjax.methods.register` and :func:`kvjax.methods.core.scorers.register_scorer` share: ``cls``
    is a dataclass subclassing ``base`` with a non-empty ``name``, and no other class holds that name in ``registry``
    (the same class loaded again, a plugin file run twice, may replace itself). ValueError naming the fix otherwise."""
    if not (isinstance(cls, type) and issubclass(cls, base) and dataclasses.is_dataclass(cls) and cls.name):
        raise ValueError(
            f"{register}({cls!r}): a {kind} is a frozen dataclass subclassing {base_path} with a non-empty "
            "`name: ClassVar[str]`"
        )
    have = registry.get(cls.name)
    if have is not None and (have.__module__, have.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(
            f"{kind} name {cls.name!r} is already registered by {have.__module__}.{have.__qualname__}; give "
            f"{cls.__qualname__} another name"
        )
