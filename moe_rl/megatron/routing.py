"""Routing capture and replay on megatron-core routers, as one explicit session object.

Shape legend: B = sequences, S = model input positions, L = MoE layers, K = top-k,
E = experts, R = router rows (megatron order: sequence-major, row = s * B + b; under
TP with sequence parallelism a rank holds S / TP consecutive positions), N = packed positions.

Packed sequences (:mod:`moe_rl.megatron.packing`): a session given the forward's ``pack`` maps
routes to and from the pack's rows (row = packed position; B = 1 inside megatron), so replayed
routes, recorded routes and natural captures stay in the ``[B, S, L, K]`` layout of the padded
batch, aligned token for token whatever the packing or micro-batch split was when they were
recorded. Positions the pack does not reach come back as expert 0..K-1 (never looked at:
``valid_BS`` masks them).

megatron-core's ``RouterReplay`` (0.16.1, 0.19.x) gives each TopKRouter an instance
whose action decides whether top-k is computed, recorded or replayed. A
:class:`RoutingSession` drives the instances of *one* policy directly (never the
class-level list, so two policies in a process do not interfere), listens to each router's
*natural* top-k, its own choice (also while replay is on, when that choice is computed and not
used: :func:`install_route_choice`), and always restores everything on exit, also when the
step raises.

Usage::

    with RoutingSession(policy, RouterAction.REPLAY, routes_BSLK=r) as rs:
        out = policy.logprobs(tokens)
        rs.backward(loss)          # switches replay to megatron's REPLAY_BACKWARD for recompute
    natural_BSLK = rs.natural_BSLK  # router's own choice in that forward
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from moe_rl.dist import all_gather_cat
from moe_rl.megatron.packing import PackedRows
from moe_rl.routing import RouterAction
from moe_rl.routing.load import router_entropy_N
from moe_rl.routing.noise import RouteNoise, selection_key


def install_route_choice(policy) -> None:
    """Route every top-k choice of ``policy``'s routers through one function (once per policy).

    megatron-core's routers take their top-k through ``RouterReplay.get_replay_topk`` (0.16.1,
    0.19.x: ``topk_routing_with_score_function``), which records, replays or computes it. Each
    router's instance method is replaced by one that

    - applies the selection noise of the forward (:class:`RouteNoise`, the value a
      :class:`RoutingSession` or :func:`routed_with` was given; none outside them) to a choice
      the router makes itself (no action, or RECORD, which then records the noisy choice):
      the top-k of the noisy key, with the gate weights gathered from the clean scores as megatron
      gathers them for replayed experts. Replayed experts (REPLAY_FORWARD / REPLAY_BACKWARD) are
      used exactly, whatever the noise;
    - under REPLAY_FORWARD with a row mask on the router's replay instance (``natural_rows_R``, set
      by a :class:`RoutingSession` given ``replay_rows``), uses the router's own choice on the rows
      it flags and the replayed experts on the others, gates gathered from the scores for both;
    - hands the router's own choice, noise included, to every listener in
      ``policy.route_listeners`` as ``(layer, indices [R, K], scores [R, E])``; under replay that
      choice is computed for them and not used. ``scores`` are those megatron-core takes the top-k
      from (the router's logits; its softmax probabilities with ``moe_router_pre_softmax``; sigmoid
      scores for a sigmoid router), without the selection noise.
    """
    if getattr(policy, "route_listeners", None) is not None:
        return
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replayed = (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD)
    policy.route_choice_noise = NO_NOISE
    policy.route_listeners = []
    for layer, router in enumerate(policy.routers):
        rr, cfg = router.router_replay, router.config
        pre_softmax, score_function = cfg.moe_router_pre_softmax, cfg.moe_router_score_function

        def choose(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None, *,
                   layer=layer, rr=rr, default=rr.get_replay_topk, pre_softmax=pre_softmax,
                   score_function=score_function):  # fmt: skip
            noise, action = policy.route_choice_noise, rr.router_replay_action
            if noise.active and (score_function != "softmax" or group_topk):
                raise ValueError(
                    "route noise supports softmax routers without group-limited top-k; this router "
                    f"has moe_router_score_function={score_function}, group_topk={group_topk}: set "
                    "train.route_noise=0 and rollout.route_noise=0"
                )

            def own_topk():  # the router's own choice: top-k of the scores, or of the noisy key
                if noise.active:
                    return noise.topk(selection_key(scores, pre_softmax=pre_softmax), topk)
                return default_compute_topk(scores, topk, num_groups, group_topk)[1]

            own = None
            mixed = (
                getattr(rr, "natural_rows_R", None) if action is RouterReplayAction.REPLAY_FORWARD else None
            )
            if mixed is not None:  # some rows replayed, the others their own choice (replay_rows)
                own = own_topk()
                idx = torch.where(mixed.to(scores.device)[:, None], own, rr.target_topk_idx.to(scores.device))
                out = scores.gather(1, idx), idx
            elif noise.active and action not in replayed:
                own = own_topk()
                if action is RouterReplayAction.RECORD:
                    rr.record_indices(own)
                out = scores.gather(1, own), own
            else:
                out = default(scores, topk, num_groups, group_topk, default_compute_topk)
                own = None if action in replayed else out[1]
            if policy.route_listeners:
                own = own_topk() if own is None else own  # replayed: computed for the listeners
                for listen in list(policy.route_listeners):
                    listen(layer, own, scores)
            return out

        rr.get_replay_topk = choose


NO_NOISE = RouteNoise()
"Selection noise off: what a forward outside any :func:`routed_with` scope routes with."


@contextlib.contextmanager
def routed_with(policy, noise: RouteNoise | None) -> Iterator[None]:
    """``policy``'s forwards inside choose their routes with selection ``noise`` (None: the noise
    around, none outside every scope), drawn from its generator, and those after it as before:
    the one place a forward's noise is set
    (:class:`RoutingSession` enters it with its ``noise``; an engine's decode loop with its own).
    The lean decoder reads it with :func:`selection_noise`."""
    install_route_choice(policy)
    outer = policy.route_choice_noise
    policy.route_choice_noise = outer if noise is None else noise
    try:
        yield
    finally:
        policy.route_choice_noise = outer


def selection_noise(policy) -> RouteNoise:
    """The selection noise ``policy``'s forwards route with now (:func:`routed_with`)."""
    install_route_choice(policy)
    return policy.route_choice_noise


def sanitize_routes(routes_NK: torch.Tensor, topk: int) -> torch.Tensor:
    """Replace rows without K distinct experts (padding rows) by 0..K-1.

    Padding rows of engine routes are zeros; megatron's dispatcher needs K distinct
    experts per row. These rows belong to positions no loss looks at.
    """
    s, _ = routes_NK.sort(dim=-1)
    bad = (s[..., 1:] == s[..., :-1]).any(-1) if topk > 1 else torch.zeros_like(s[..., 0], dtype=torch.bool)
    if bool(bad.any()):
        routes_NK = routes_NK.clone()
        routes_NK[bad] = torch.arange(topk, device=routes_NK.device, dtype=routes_NK.dtype)
    return routes_NK


class _RoutesCaptured(Exception):
    """Raised by the last router of a ``stop_after_routes`` session; the session swallows it."""


class RoutingSession:
    """One forward (and its backward) of ``policy`` under a router action.

    ``stop_after_routes`` (natural capture, no gradients) ends the forward as soon as the last
    router has chosen: the routes are exactly those of a full forward (everything up to the last
    router is computed the same way), and the last layer's experts and the output layer are
    skipped. The session swallows the exception that ends it; the forward returns nothing.

    Gates: RECORD keeps the gate weights of the recorded experts (:meth:`recorded_gates_BSLK`);
    NATURAL with ``capture_gates`` keeps those of the router's own choice in every forward
    (:meth:`natural_gate_steps`; under selection noise, the clean scores of the noisy choice, which
    is what the router outputs); REPLAY with ``gates_BSLK`` replaces the router's gate weights of
    the replayed experts by those (the router then gets no gradient through its gates; its aux and
    z losses still reach it).

    ``entropy``: also keep the entropy of every router's softmax over the experts, per token, of
    the first forward (:meth:`router_entropy_BSL`; softmax routers only).

    ``replay_rows`` (REPLAY, no gradients): bool ``[B]``, the rows whose ``routes_BSLK`` are replayed;
    the other rows route as under NATURAL (their entries of ``routes_BSLK`` are not read). One
    forward then serves both a natural and a replayed pass of the same tokens (the routing share's
    probe); the gates of every row are the router's scores at the experts used, as megatron-core
    gathers them for replayed experts and as its top-k returns them for its own.

    ``noise``: the selection noise of the routers' own choices in the session's forwards
    (:mod:`moe_rl.routing.noise`; None: that of the forwards around it, none outside every
    :func:`routed_with`), a value its caller owns (the trainer's per RL step,
    an engine's per call); replayed experts are used exactly whatever it is.
    """

    def __init__(
        self,
        policy,
        action: RouterAction,
        *,
        routes_BSLK: torch.Tensor | None = None,
        gates_BSLK: torch.Tensor | None = None,
        replay_rows: torch.Tensor | None = None,
        pack: PackedRows | None = None,
        stop_after_routes: bool = False,
        capture_gates: bool = False,
        entropy: bool = False,
        noise: RouteNoise | None = None,
    ):
        if action is RouterAction.REPLAY and routes_BSLK is None:
            raise ValueError("RouterAction.REPLAY needs routes_BSLK (the experts to replay)")
        if gates_BSLK is not None and action is not RouterAction.REPLAY:
            raise ValueError("gates_BSLK are replayed with the routes: they need RouterAction.REPLAY")
        if replay_rows is not None and (action is not RouterAction.REPLAY or gates_BSLK is not None):
            raise ValueError(
                "replay_rows chooses the replayed rows of RouterAction.REPLAY (without gates_BSLK)"
            )
        if replay_rows is not None and tuple(replay_rows.shape) != tuple(routes_BSLK.shape[:1]):
            raise ValueError(f"replay_rows needs one flag per row of routes_BSLK {tuple(routes_BSLK.shape)}")
        if stop_after_routes and action is not RouterAction.NATURAL:
            raise ValueError("stop_after_routes is for natural-routing captures (RouterAction.NATURAL)")
        if capture_gates and (action is not RouterAction.NATURAL or stop_after_routes):
            raise ValueError("capture_gates is for full natural-routing forwards (RouterAction.NATURAL)")
        self.policy = policy
        self.action = action
        self.routes_BSLK = routes_BSLK
        self.gates_BSLK = gates_BSLK
        self.replay_rows = replay_rows
        self.pack = pack
        self.stop_after_routes = stop_after_routes
        self.capture_gates = capture_gates
        self.noise = noise
        self._noise_scope: contextlib.AbstractContextManager | None = None
        self.topk = policy.cfg.moe_router_topk
        self._natural: list[list[torch.Tensor]] = []
        self.entropy = entropy
        self._entropy: list[list[torch.Tensor]] = []
        self._chosen_gates: list[list[torch.Tensor]] = []
        self._hooks: list = []
        self._shape: tuple[int, int] | None = None
        self._capturing = False

    # -- megatron row layout --------------------------------------------------------------
    def _local_rows(self, x_BSLK: torch.Tensor, layer: int) -> torch.Tensor:
        """This rank's router rows of layer ``layer`` from a [B, S, L, K] tensor."""
        info = self.policy.info
        if self.pack is not None:  # one packed sequence: B = 1, S = the pack's P positions
            x_NK = self.pack.gather_BS(x_BSLK[:, :, layer])
            fill = torch.arange(self.topk, dtype=x_NK.dtype).expand(self.pack.p - self.pack.n, self.topk)
            x_BSLK = torch.cat([x_NK, fill.to(x_NK)])[None, :, None]
            layer = 0
        b, s = x_BSLK.shape[:2]
        pad = (-s) % info.tp_size
        x = x_BSLK[:, :, layer]
        if pad:
            fill = torch.arange(self.topk, dtype=x.dtype).expand(b, pad, self.topk)
            x = torch.cat([x, fill.to(x)], dim=1)
        per = (s + pad) // info.tp_size
        x = x[:, info.tp_rank * per : (info.tp_rank + 1) * per]
        return x.transpose(0, 1).reshape(-1, x.shape[-1])

    def _to_BSLK(self, per_layer_RK: list[torch.Tensor], b: int, s: int) -> torch.Tensor:
        info = self.policy.info
        out = []
        for r in per_layer_RK:
            if self.pack is not None:
                r_NK = all_gather_cat(r, info.tp_group, dim=0)[: self.pack.n]
                if (b, s) != (self.pack.b, self.pack.s):
                    raise ValueError(f"the pack holds a [{self.pack.b}, {self.pack.s}] batch, not [{b}, {s}]")
                k = r.shape[-1]
                fill = torch.arange(k, device=r.device).expand(b, s, k).to(r.dtype)
                if r.is_floating_point():  # gates: 0 where nothing was routed
                    fill = torch.zeros_like(fill)
                idx = (self.pack.row_N.to(r.device), self.pack.pos_N.to(r.device))
                out.append(fill.clone().index_put(idx, r_NK))
                continue
            r_SBK = r.view(-1, b, r.shape[-1])
            r_SBK = all_gather_cat(r_SBK, info.tp_group, dim=0)  # sequence-parallel shards
            out.append(r_SBK[:s].transpose(0, 1))
        return torch.stack(out, dim=2)

    # -- context ---------------------------------------------------------------------------
    def __enter__(self) -> RoutingSession:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._noise_scope = routed_with(self.policy, self.noise)
        self._noise_scope.__enter__()
        self._capturing = True
        self.policy.route_listeners.append(self._listen)
        for i, router in enumerate(self.policy.routers):
            rr = router.router_replay
            rr.clear_indices()
            if self.action is RouterAction.RECORD:
                rr.set_router_replay_action(RouterReplayAction.RECORD)
            elif self.action is RouterAction.REPLAY:
                rows = self._local_rows(self.routes_BSLK, i).to(torch.int64)
                rr.set_target_indices(sanitize_routes(rows, self.topk).to(router.weight.device))
                rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                if self.replay_rows is not None:  # per router row: its own choice where not replayed
                    flags = self.replay_rows.to(torch.int64)[:, None, None, None].expand(
                        self.routes_BSLK.shape
                    )
                    rr.natural_rows_R = self._local_rows(flags, i)[:, 0] == 0  # padding: natural
            self._wrap(i, router)
        return self

    def _listen(self, layer: int, own_NK: torch.Tensor, scores_NE: torch.Tensor) -> None:
        """The router's own top-k of ``layer`` in this forward (:func:`install_route_choice`) and,
        with ``entropy``, the entropy of its softmax over the experts (first forward only)."""
        if not self._capturing:
            return
        self._natural[layer].append(own_NK.detach())
        if self.entropy and not self._entropy[layer]:
            cfg = self.policy.routers[layer].config
            if cfg.moe_router_score_function == "softmax":
                with torch.no_grad():
                    h_N = router_entropy_N(scores_NE.detach(), probabilities=cfg.moe_router_pre_softmax)
                self._entropy[layer].append(h_N[:, None])
        if self.stop_after_routes and layer == len(self.policy.routers) - 1:
            raise _RoutesCaptured

    def _wrap(self, i: int, router) -> None:
        self._natural.append([])
        self._entropy.append([])
        gates = []
        self._chosen_gates.append(gates)
        if self.action is RouterAction.RECORD:

            def record_gates(module, args, output):
                if self._capturing:
                    probs, routing_map = output
                    idx = module.router_replay.recorded_topk_idx
                    gates.append(probs.detach().gather(1, idx))

            self._hooks.append(("hook", router.register_forward_hook(record_gates)))
        elif self.action is RouterAction.NATURAL and self.capture_gates:
            own = self._natural[i]

            def natural_gates(module, args, output):
                if self._capturing:  # the router's output at its own choice (listened to just before)
                    gates.append(output[0].detach().gather(1, own[-1]).float())

            self._hooks.append(("hook", router.register_forward_hook(natural_gates)))
        elif self.action is RouterAction.REPLAY and self.gates_BSLK is not None:
            rows_g = self._local_rows(self.gates_BSLK, i)

            def replay_gates(module, args, output):
                probs, routing_map = output
                idx = module.router_replay.target_topk_idx.to(probs.device)
                fixed = torch.zeros_like(probs).scatter(1, idx, rows_g.to(probs))
                # straight through: the forward mixes the experts with the replayed gates, the
                # backward takes the live gates' gradient, so the router keeps learning (replayed
                # as constants, it would get no policy gradient at all); probs stays in the graph,
                # where megatron attaches its aux loss (MoEAuxLossAutoScaler)
                return probs + (fixed - probs).detach(), routing_map

            self._hooks.append(("hook", router.register_forward_hook(replay_gates)))

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss``; replayed routes also serve activation recompute."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._capturing = False
        if self.replay_rows is not None:
            raise RuntimeError("a session with replay_rows is for forwards without gradients")
        if self.action is RouterAction.REPLAY:
            for router in self.policy.routers:
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        loss.backward()

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._capturing = False
        if self._listen in self.policy.route_listeners:
            self.policy.route_listeners.remove(self._listen)
        for _, hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for router in self.policy.routers:
            router.router_replay.natural_rows_R = None
            router.router_replay.clear_router_replay_action()
            if self.action is not RouterAction.RECORD:
                router.router_replay.clear_indices()
        if self._noise_scope is not None:
            self._noise_scope.__exit__(None, None, None)
            self._noise_scope = None
        return exc_type is _RoutesCaptured  # the early end of a routes-only forward

    # -- results ---------------------------------------------------------------------------
    def natural_BSLK(self, b: int, s: int) -> torch.Tensor:
        """The router's own top-k (sorted by score) of the first forward, [B, S, L, K]."""
        if not self._natural or not all(self._natural):
            raise RuntimeError("no routing was captured: run a forward inside the session")
        return self._to_BSLK([n[0] for n in self._natural], b, s)

    def router_entropy_BSL(self, b: int, s: int) -> torch.Tensor | None:
        """Entropy (nats) of each router's softmax over the experts in the first forward, [B, S, L]
        float32 (0 where nothing was routed); None without ``entropy`` or for a non-softmax router."""
        if not self._entropy or not all(self._entropy):
            return None
        return self._to_BSLK([h[0] for h in self._entropy], b, s)[..., 0]

    def natural_steps(self) -> list[list[torch.Tensor]]:
        """Every captured forward's natural top-k per layer, [R, K] each (for decoding loops)."""
        return [list(x) for x in zip(*self._natural)]

    def recorded_BSLK(self, b: int, s: int) -> torch.Tensor:
        """The experts the recorded forward used, [B, S, L, K] (RouterAction.RECORD)."""
        if self.action is not RouterAction.RECORD:
            raise RuntimeError("recorded_BSLK needs RouterAction.RECORD")
        rows = [r.router_replay.recorded_topk_idx for r in self.policy.routers]
        if any(r is None for r in rows):
            raise RuntimeError("nothing was recorded: run a forward inside the session")
        out = self._to_BSLK(rows, b, s)
        for r in self.policy.routers:
            r.router_replay.clear_indices()
        return out

    def recorded_gates_BSLK(self, b: int, s: int) -> torch.Tensor:
        """Gate weights of the recorded experts, [B, S, L, K] (RouterAction.RECORD)."""
        return self._to_BSLK([g[0] for g in self._chosen_gates], b, s)

    def natural_gate_steps(self) -> list[list[torch.Tensor]]:
        """Every captured forward's gate weights of the router's own top-k per layer, [R, K] float32
        each, aligned with :meth:`natural_steps` (NATURAL with ``capture_gates``)."""
        if not self.capture_gates:
            raise RuntimeError("natural_gate_steps needs RoutingSession(capture_gates=True)")
        return [list(x) for x in zip(*self._chosen_gates)]
