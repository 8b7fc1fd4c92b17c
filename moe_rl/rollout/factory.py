"""Build the SGLang rollout engine a recipe asks for: attach or launch engines (and sglang-router),
place them on GPUs, and wire weight sync to every engine.

Every rank of the trainer gets a client to the generation endpoint (the router with 2+ engines)
and generates its own share of the prompts; rank 0 alone pushes weights (one group over every
engine, or disk, or colocated tensors), the other ranks only take part in gathering the full
tensors and then adopt the new version. Launched engines and the router run on rank 0's node.

Across nodes (the trainer's world spans more than one: :func:`trainer_spans_nodes`) every rank
must reach them: launched engines listen on rank 0's routable address, or on all interfaces with
an API key, and the URL broadcast to the other ranks is never loopback (:func:`engine_address`);
attached URLs that are loopback are refused.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from moe_rl import dist
from moe_rl.config import ConfigError
from moe_rl.dist import free_port, host_port
from moe_rl.megatron.hf import export_hf
from moe_rl.rollout.colocated import (
    colocated_payload_ranks,
    colocated_placement,
    trainer_gpus,
    trainer_layout,
)
from moe_rl.rollout.sglang_client import SGLangClient, url_host
from moe_rl.rollout.sglang_engine import SGLangEngine
from moe_rl.rollout.sglang_launcher import SGLangLaunchError, check_disjoint, plan_gpus
from moe_rl.rollout.sglang_router import Fleet, SGLangRouterLauncher
from moe_rl.rollout.types import HFStateSource, Rollouts, SamplingParams
from moe_rl.rollout.weight_sync import DiskWeightSync, DistributedWeightSync, TensorWeightSync
from moe_rl.rollout.weight_sync.address import (
    is_loopback,
    is_wildcard,
    local_dial,
    pin_nccl_interface,
    route_address,
)
from moe_rl.rollout.weight_sync.session import source_tensors

if TYPE_CHECKING:
    from moe_rl.config import Recipe, RolloutConfig
    from moe_rl.megatron.policy import Policy
    from moe_rl.sglang_config import SGLangConfig
    from moe_rl.tasks import Tokenizer

log = logging.getLogger(__name__)
SGLANG_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"rollout.dtype -> SGLang's --dtype, passed explicitly (its 'auto' serves an fp32 checkpoint in fp16)."


class RankedSGLangEngine:
    """SGLangEngine on every rank; weight pushes and (colocated) memory calls from rank 0 only.

    Colocated, the memory calls come from the trainer, ordered with its own memory and between
    barriers on every rank (:mod:`moe_rl.trainer.colocate`): every rank's inner engine follows
    which tags are resident, rank 0's makes the calls."""

    def __init__(self, inner: SGLangEngine, rank: int):
        self.inner, self.rank = inner, rank
        inner.auto_memory = False
        inner.calls_memory = rank == 0

    @property
    def weight_version(self) -> str:
        return self.inner.weight_version

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> Rollouts:
        return self.inner.generate(prompts, n, sampling)

    def resume_memory(self, phase: str = "rollout") -> None:
        """Colocated: the engines take back what ``phase`` needs (rank 0 calls them)."""
        self.inner.resume_memory(phase)

    def release_memory(self) -> None:
        """Colocated: the engines give back all their memory (rank 0 calls them)."""
        self.inner.release_memory()

    def take_push_probes(self) -> list | None:
        """Rank 0's probes of a due push check, on every rank (collective when one is due)."""
        if self.inner.verifier.score_due is None:
            return None
        return dist.broadcast_object(self.inner.take_push_probes())

    def update_weights(self, source: HFStateSource, version: str) -> str:
        if self.rank == 0:
            self.inner.update_weights(source, version)
        else:  # the source's gathers are collective (and a colocated push's payloads): take part
            self.inner.verifier.count(version)  # a check is due on every rank alike
            contribute = getattr(self.inner.weight_sync, "contribute", None)
            if contribute is not None:
                contribute(source)
            else:
                for _ in source_tensors(source, dist.group_device()):
                    pass
            self.inner.weight_version = version
        dist.barrier()
        return version

    def close(self) -> None:
        """Rank 0: the weight sync and its launched engines (and router); another node's first rank:
        the engines it launched."""
        if self.rank == 0:
            self.inner.close()
        elif self.inner.launcher is not None:
            self.inner.launcher.stop()


def pin_nccl_for_engines(recipe, *, nccl: bool) -> str | None:
    """Before the process's first NCCL call: ``NCCL_SOCKET_IFNAME`` set to the interface the
    recipe's remote SGLang engines reach this process at (distributed weight sync over NCCL only;
    NCCL reads it once per process, so set later it would do nothing). The interface, or None."""
    rollout = recipe.rollout
    if rollout.engine != "sglang" or rollout.weight_sync != "distributed" or not nccl:
        return None
    cfg = rollout.sglang
    urls = [cfg.url] if cfg.url else cfg.engines if isinstance(cfg.engines, list) else []
    hosts = [url_host(u) for u in urls] or [_launch_host(cfg)]
    return pin_nccl_interface(hosts, configured=cfg.trainer_address)


def _launch_host(cfg: SGLangConfig) -> str:
    """Before the process groups start: an address of the node launched engines run on (rank 0's),
    as every rank can tell from its environment (the engines' own is chosen by rank 0 later)."""
    if cfg.host and not is_wildcard(cfg.host):
        return cfg.host
    if not spans_nodes():
        return "127.0.0.1"
    return cfg.trainer_address or os.environ.get("MOE_RL_TRAINER_ADDR") or os.environ.get("MASTER_ADDR", "")


def spans_nodes(env: Mapping[str, str] | None = None) -> bool:
    """True when the environment says this trainer's world runs on more than one node:
    torchrun's (and Slurm + torchrun's) ``LOCAL_WORLD_SIZE`` smaller than ``WORLD_SIZE``."""
    env = os.environ if env is None else env
    local = env.get("LOCAL_WORLD_SIZE")
    try:
        return bool(local) and int(env.get("WORLD_SIZE", "1")) > int(local)
    except ValueError:
        return False


def trainer_spans_nodes(env: Mapping[str, str] | None = None) -> bool:
    """Whether the trainer's ranks are on more than one node, the same answer on every rank
    (collective): :func:`spans_nodes` on any rank, or ranks on different hosts."""
    here = (socket.gethostname(), spans_nodes(env))
    if dist.world_size() < 2:
        return here[1]
    every = dist.all_gather_object(here)
    return any(flag for _, flag in every) or len({host for host, _ in every}) > 1


def engine_address(
    cfg: SGLangConfig, *, multi_node: bool, env: Mapping[str, str] | None = None
) -> tuple[str, str]:
    """``(bind, dial)`` of engines (and router) launched by rank 0 on its node: the address they
    listen on and the one every trainer rank dials (what is broadcast).

    One node: ``rollout.sglang.host`` (default 127.0.0.1). Across nodes: the explicit host when it
    is routable (loopback is refused: ranks elsewhere would dial their own), all interfaces
    (0.0.0.0 / ::, only with ``rollout.sglang.api_key``) dialled at the node's routable address,
    else that address (:func:`node_address`). ConfigError, one line, naming what to set."""
    host = cfg.host
    if host is not None and is_wildcard(host):
        if not cfg.api_key:
            raise ConfigError(
                f"rollout.sglang.host={host} listens on every interface: set rollout.sglang.api_key too "
                "(or bind one address)"
            )
        if not multi_node:
            return host, local_dial(host)
        return host, node_address(cfg, env)
    if host is not None:
        if multi_node and is_loopback(host.strip("[]")):
            raise ConfigError(
                f"rollout.sglang.host={host} is loopback but the trainer spans several nodes: ranks on the "
                "other nodes would dial their own; set it to this node's routable address, or leave it "
                "unset (null) to use it"
            )
        return host, host
    if not multi_node:
        return "127.0.0.1", "127.0.0.1"
    address = node_address(cfg, env)
    return address, address


def node_address(cfg: SGLangConfig, env: Mapping[str, str] | None = None) -> str:
    """Rank 0's routable address, where the other nodes reach engines it launches:
    ``rollout.sglang.trainer_address``, else ``$MOE_RL_TRAINER_ADDR``, else the local address of
    the route to ``$MASTER_ADDR``. Never loopback; it must be an address of this node."""
    env = os.environ if env is None else env
    candidates = [
        ("rollout.sglang.trainer_address", cfg.trainer_address),
        ("$MOE_RL_TRAINER_ADDR", env.get("MOE_RL_TRAINER_ADDR")),
    ]
    master = env.get("MASTER_ADDR")
    if master:
        candidates.append((f"the route to $MASTER_ADDR={master}", route_address(master)))
    for source, address in candidates:
        if not address:
            continue
        address = address.strip("[]")
        if is_loopback(address):
            raise ConfigError(
                f"{source} gives the loopback address {address!r}, which the trainer's other nodes cannot "
                "reach: set rollout.sglang.host to this node's routable address"
            )
        try:
            free_port(address)
        except OSError as e:
            raise ConfigError(
                f"{source} gives {address!r}, which this node (trainer rank 0's, where engines are launched) "
                f"cannot listen on ({e.strerror or e}): set rollout.sglang.host to one of its addresses"
            ) from None
        log.info(
            "launched SGLang engines listen on %s (from %s): the trainer spans several nodes", address, source
        )
        return address
    raise ConfigError(
        "the trainer spans several nodes and no routable address of rank 0's node is known "
        "(no rollout.sglang.trainer_address, $MOE_RL_TRAINER_ADDR or $MASTER_ADDR): set rollout.sglang.host"
    )


def check_reachable(urls: list[str], router_url: str | None, *, multi_node: bool, what: str) -> None:
    """Across nodes, a loopback engine or router URL would send every rank to its own node: refused."""
    if not multi_node:
        return
    for url in [*urls, *([router_url] if router_url else [])]:
        if is_loopback(url_host(url)):
            raise ConfigError(
                f"{what} {url} is loopback but the trainer spans several nodes: ranks on the other nodes "
                "would dial their own; give an address every node reaches"
            )


def engine_gpus(cfg: SGLangConfig, n: int, trainer: list[int]) -> list[tuple[int, ...] | None]:
    """Device mask of each launched engine; ConfigError when they would land on the trainer's GPUs."""
    gpus = cfg.gpus if cfg.gpus is not None else (trainer if cfg.colocate and trainer else None)
    if gpus is None:
        if trainer:
            raise ConfigError(
                f"rollout.sglang.gpus is not set: a launched engine would share the trainer's GPUs {trainer} "
                f"and reserve {cfg.mem_fraction:.0%} of their memory. List the GPUs the engines use "
                f"(engine i gets gpus[i*tp:(i+1)*tp]) or set rollout.sglang.colocate=true"
            )
        return [None] * n
    try:
        if not cfg.colocate:
            check_disjoint(gpus, trainer)
        return list(plan_gpus(gpus, n, cfg.tp))
    except ValueError as e:
        raise ConfigError(str(e)) from e


def launch_fleet(
    recipe: Recipe,
    out: Path,
    model_path: str,
    *,
    multi_node: bool | None = None,
    masks: list[tuple[int, ...] | None] | None = None,
    first: int = 0,
    address: tuple[str, str] | None = None,
    router: bool = True,
):
    """Launch the engines (and the router with 2+) the recipe asks for on this node, logging under
    ``out/logs``; returns (Fleet, engine URLs, router URL).

    ``multi_node``: whether the trainer spans several nodes (None: :func:`spans_nodes`); the
    engines then listen where the other nodes reach them (:func:`engine_address`). One node's
    share of colocated engines across nodes (:func:`moe_rl.rollout.colocated.launch_on_every_node`):
    ``masks`` their GPUs, ``first`` the index of the first, ``address`` this node's (bind, dial),
    no ``router``."""
    from moe_rl.rollout.sglang_launcher import SGLangLauncher, SGLangServerConfig

    cfg = recipe.rollout.sglang
    bind, dial = address or engine_address(
        cfg, multi_node=spans_nodes() if multi_node is None else multi_node
    )
    masks = engine_gpus(cfg, cfg.num_engines, trainer_gpus()) if masks is None else masks
    dtype = SGLANG_DTYPES[recipe.rollout_dtype]
    if dtype != recipe.model.dtype:
        log.info(
            "SGLang engines serve rollout.dtype=%s (--dtype %s) from %s weights: cast on load and on every push",
            recipe.rollout_dtype,
            dtype,
            recipe.model.dtype,
        )
    launchers = []
    fleet = Fleet(launchers)
    try:
        for i, mask in enumerate(masks, first):
            server_cfg = SGLangServerConfig(
                model_path=model_path,
                tp_size=cfg.tp,
                ep_size=cfg.ep,
                host=bind,
                advertise_host=dial,
                port=(cfg.port or None) if i == 0 else None,
                enable_return_routed_experts=recipe.algo.routing.wants_engine_routes,
                mem_fraction_static=cfg.mem_fraction,
                dtype=dtype,
                module=cfg.module,
                gpu_ids=mask,
                enable_memory_saver=cfg.colocate,
                enable_weights_cpu_backup=cfg.colocate,  # a rollout after a rollout keeps its weights
                api_key=cfg.api_key,
                admin_api_key=cfg.admin_api_key,
            )
            launcher = SGLangLauncher(
                server_cfg,
                log_path=Path(out) / "logs" / f"sglang-{i}.log",
                startup_timeout_s=cfg.startup_timeout_s,
            )
            launchers.append(launcher)
            launcher.start()
        urls = [launcher.url for launcher in launchers]
        router_url = start_router(recipe, out, fleet, urls, (bind, dial)) if router else None
    except BaseException:
        fleet.stop()
        raise
    return fleet, urls, router_url


def start_router(recipe: Recipe, out: Path, fleet, urls: list[str], address: tuple[str, str]) -> str | None:
    """The router URL: ``rollout.sglang.router_url``, else (2+ engines) sglang-router launched here
    over ``urls`` at ``address`` (bind, dial), owned by ``fleet``; None for one engine."""
    cfg = recipe.rollout.sglang
    if len(urls) < 2 or cfg.router_url is not None:
        return cfg.router_url
    fleet.router = SGLangRouterLauncher(
        urls,
        host=address[0],
        policy=cfg.router_policy,
        api_key=cfg.api_key,
        log_path=Path(out) / "logs" / "sglang-router.log",
        request_timeout_s=recipe.rollout.timeout_s,
    )
    fleet.router.start()
    return f"http://{host_port(address[1], fleet.router.port)}"  # not 0.0.0.0 / ::


def engine_start(recipe: Recipe, *, policy: Policy, tokenizer: Tokenizer, out: Path) -> str | None:
    """The checkpoint launched engines start from: ``rollout.sglang.model_path``, else ``policy`` as
    it is now, exported with ``tokenizer`` to ``out/hf_init`` (collective); None for attached engines."""
    cfg = recipe.rollout.sglang
    if cfg.url is not None or isinstance(cfg.engines, list):
        return None
    if cfg.model_path:
        return cfg.model_path

    path = str(Path(out) / "hf_init")
    export_hf(policy, path, tokenizer=tokenizer)
    return path


def build_sglang_engine(
    recipe: Recipe,
    *,
    policy: Policy,
    tokenizer: Tokenizer,
    out: Path,
    rank: int,
    model_path: str | None = None,
) -> RankedSGLangEngine:
    """The SGLang engine of ``recipe`` on trainer rank ``rank``: attach to the recipe's URLs, or
    launch engines (from ``model_path``, else :func:`engine_start`'s; logs and disk weight sync
    under ``out``)."""
    rollout_cfg, model_cfg = recipe.rollout, recipe.model
    cfg = rollout_cfg.sglang
    fleet, router_url = None, cfg.router_url
    multi_node = trainer_spans_nodes()
    if cfg.url is not None or isinstance(cfg.engines, list):
        urls = [cfg.url] if cfg.url is not None else list(cfg.engines)
        check_reachable(
            urls, router_url, multi_node=multi_node, what="rollout.sglang.url / engines / router_url"
        )
    else:
        model_path = model_path or engine_start(recipe, policy=policy, tokenizer=tokenizer, out=out)
        if cfg.colocate and multi_node:  # colocated engines on every node (slime's layout)
            fleet, urls, router_url = launch_on_every_node(recipe, out, model_path, rank)
        else:
            fleet, urls, router_url = _launch_on_rank0(recipe, out, model_path, multi_node, rank)
    if len(urls) > 1 and router_url is None:
        raise ConfigError("rollout.sglang.engines lists several URLs: set rollout.sglang.router_url too")
    key = cfg.admin_api_key or cfg.api_key
    kw = {"timeout_s": rollout_cfg.timeout_s, "retries": rollout_cfg.retries}
    engines = [SGLangClient(u, api_key=key, **kw) for u in urls]
    if cfg.colocate and fleet is None and (cfg.url is not None or isinstance(cfg.engines, list)):
        check_colocated_servers(engines)
    front = SGLangClient(router_url, api_key=cfg.api_key, **kw) if router_url else engines[0]
    tensor = rollout_cfg.weight_sync == "tensor"  # every rank builds its own GPU's payloads
    sync = _weight_sync(rollout_cfg, out, engines) if rank == 0 or tensor else None
    inner = SGLangEngine(
        front,
        engines=engines,
        num_layers=model_cfg.num_layers,
        topk=model_cfg.moe_router_topk,
        num_experts=model_cfg.num_experts,
        pad_id=tokenizer.pad_id,
        weight_sync=sync,
        launcher=fleet,
        step_deadline_s=cfg.step_deadline_s,
        max_concurrency=cfg.max_concurrency,
        colocated=cfg.colocate,
        verify_every=rollout_cfg.verify_every,
        vocab_size=tokenizer.vocab_size,
        context=model_cfg.max_seq_len,
    )
    return RankedSGLangEngine(inner, rank)


def check_colocated_servers(engines: list[SGLangClient]) -> None:
    """Attached colocated engines must release memory (``--enable-memory-saver``) and keep their
    weights across a release (``--enable-weights-cpu-backup``: without it SGLang frees them, and a
    rollout that follows another without a push would serve garbage). A server that does not say
    (``moe-rl serve``, which keeps its weights) is taken as it is."""
    for e in engines:
        info = e.server_info()
        for flag in ("enable_memory_saver", "enable_weights_cpu_backup"):
            if info.get(flag) is False:
                raise ConfigError(
                    f"rollout.sglang.colocate=true but {e.base_url} runs without --{flag.replace('_', '-')}: "
                    "relaunch it with --enable-memory-saver --enable-weights-cpu-backup, or set colocate=false"
                )


def _launch_on_rank0(recipe: Recipe, out: Path, model_path: str, multi_node: bool, rank: int):
    """Rank 0 launches the fleet and broadcasts its URLs (never loopback across nodes); a failure
    there is raised on every rank (the others would otherwise wait in the broadcast)."""
    fleet = urls = router_url = failure = None
    if rank == 0:
        try:
            fleet, urls, router_url = launch_fleet(recipe, out, model_path, multi_node=multi_node)
            check_reachable(urls, router_url, multi_node=multi_node, what="launched SGLang engine")
        except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks are told
            failure = e
            if fleet is not None:
                fleet.stop()
    if failure is not None:
        first = (str(failure).splitlines() or [""])[0]
        error = (isinstance(failure, ConfigError), first or type(failure).__name__)
    else:
        error = None
    urls, router_url, error = dist.broadcast_object((urls, router_url, error))
    if failure is not None:
        raise failure
    if error is not None:
        is_config, message = error
        if is_config:
            raise ConfigError(message)
        raise SGLangLaunchError(
            f"trainer rank 0 could not launch the SGLang engines: {message} (see its log)"
        )
    return fleet, urls, router_url


def _weight_sync(rollout_cfg: RolloutConfig, out: Path, engines: list[SGLangClient]):
    """Rank 0's pusher to every engine, as the recipe's rollout section asks."""
    tp_sizes = [rollout_cfg.sglang.tp] * len(engines)
    if rollout_cfg.weight_sync == "disk":
        return DiskWeightSync(engines, rollout_cfg.weight_sync_dir or Path(out) / "weights")
    if rollout_cfg.weight_sync == "tensor":  # collective: every rank builds its engine rank's payloads
        ranks = colocated_payload_ranks(rollout_cfg.sglang, len(engines))
        return TensorWeightSync(
            engines, tp_sizes=tp_sizes, timeout_s=rollout_cfg.timeout_s, payload_ranks=ranks
        )
    return DistributedWeightSync(
        engines,
        tp_sizes=tp_sizes,
        master_address=rollout_cfg.sglang.trainer_address,
        timeout_s=rollout_cfg.timeout_s,
    )


def own_address(cfg: SGLangConfig, node: int, env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(bind, dial) of engines launched on ``node``: rank 0's node as
    :func:`moe_rl.rollout.factory.engine_address` says; another node at its own routable address,
    the local end of its route to ``$MASTER_ADDR`` (all interfaces with a wildcard host)."""

    if node == 0:
        return engine_address(cfg, multi_node=True, env=env)
    env = os.environ if env is None else env
    if cfg.host is not None and not is_wildcard(cfg.host):
        raise ConfigError(
            f"rollout.sglang.host={cfg.host} names one address, but colocated engines run on every node: leave "
            "it unset (each node's routable address) or use 0.0.0.0 with rollout.sglang.api_key"
        )
    master = env.get("MASTER_ADDR")
    address = route_address(master) if master else None
    if not address or is_loopback(address.strip("[]")):
        raise ConfigError(
            f"node {node} has no routable address toward $MASTER_ADDR={master} for its colocated engines: "
            "run the trainer with MASTER_ADDR set to rank 0's routable address"
        )
    address = address.strip("[]")
    return (cfg.host, address) if cfg.host is not None else (address, address)


def launch_on_every_node(recipe: Recipe, out: Path, model_path: str, rank: int):
    """Each node's first rank launches that node's colocated engines; rank 0 the router over all
    of them. Every rank returns (its Fleet or None, every engine URL in placement order, router
    URL); a failure on any node is raised on every rank. Collective."""
    cfg = recipe.rollout.sglang
    layout = trainer_layout()
    node = layout[rank][0]
    fleet = urls = failure = None
    try:
        placement = colocated_placement(cfg, cfg.num_engines, layout)
        if rank == min(r for r, (n, _) in enumerate(layout) if n == node):
            mine = [i for i, (n, _) in enumerate(placement) if n == node]
            fleet, urls, _ = launch_fleet(
                recipe,
                out,
                model_path,
                masks=[placement[i][1] for i in mine],
                first=mine[0],
                address=own_address(cfg, node),
                router=False,
            )
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        failure = e
    every = dist.all_gather_object((urls or [], _said(failure, node)))
    errors = [err for _, err in every if err is not None]
    router_url = None
    if not errors and rank == 0:
        try:
            router_url = start_router(
                recipe, out, fleet, [url for node_urls, _ in every for url in node_urls], own_address(cfg, 0)
            )
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            failure = e
    router_url, error = dist.broadcast_object((router_url, _said(failure, node) if rank == 0 else None))
    errors += [error] if error else []
    if errors:
        if fleet is not None:
            fleet.stop()
        is_config, message = errors[0]
        raise (ConfigError(message) if is_config else SGLangLaunchError(message)) from failure
    return fleet, [url for node_urls, _ in every for url in node_urls], router_url


def _said(failure: Exception | None, node: int) -> tuple[bool, str] | None:
    """A failure as every rank can raise it: (is a ConfigError, one line naming the node)."""
    if failure is None:
        return None
    first = (str(failure).splitlines() or [""])[0] or type(failure).__name__
    return isinstance(
        failure, ConfigError
    ), f"node {node} could not launch its colocated SGLang engines: {first}"
