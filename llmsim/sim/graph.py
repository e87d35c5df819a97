"""The layer graph (DESIGN.md stage 1): what each layer holds, saves and needs transiently.

Nodes are the decoder layers (by FQN) and the modules around them (embedding, final norm, LM head and
loss) in execution order; edges are the data flow of the forward. Attributes come from the steady-state
step (the last traced step) of the full-depth timeline.
"""
from __future__ import annotations

import networkx as nx
import numpy as np
import pandas as pd

from llmsim.enums import Category, Phase
from llmsim.model.step import StepInfo
from llmsim.model.tracker import NO_BLOCK


def _node(block: int, module: str, info: StepInfo) -> str:
    return f"{info.blocks_prefix}.{block}" if block != NO_BLOCK else module


def _owner(block: int, parameter: str, info: StepInfo) -> str:
    """The module a parameter (`lm_head.weight`) belongs to."""
    return _node(block, parameter.rpartition(".")[0], info)


def _transient_peak(deltas: np.ndarray) -> int:
    return int(np.cumsum(deltas).max(initial=0))


def layer_graph(timeline: pd.DataFrame, info: StepInfo) -> nx.DiGraph:
    graph = nx.DiGraph()
    nodes = [_node(b, m, info) for b, m in zip(timeline["block"], timeline["module"])]
    timeline = timeline.assign(node=nodes)
    build = timeline[(timeline["phase"] == Phase.BUILD.value) & (timeline["category"] == Category.PARAMETER.value)]
    owners = [_owner(b, m, info) for b, m in zip(build["block"], build["module"])]
    param_bytes = build.assign(node=owners).groupby("node")["delta_bytes"].sum()
    last = timeline[timeline["step"] == timeline["step"].max()]
    order: list[str] = []
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        events = last[last["phase"] == phase.value]
        for node, group in events.groupby("node", sort=False):
            if node not in graph:
                graph.add_node(node, param_bytes=int(param_bytes.get(node, 0)))
            if phase is Phase.FORWARD:
                order.append(node)
                saved = group[group["category"] == Category.ACTIVATION.value]["delta_bytes"]
                graph.nodes[node]["saved_bytes"] = int(saved[saved > 0].sum())
            graph.nodes[node][f"{phase.value}_transient_peak_bytes"] = _transient_peak(
                group["delta_bytes"].to_numpy())
    nx.add_path(graph, order)
    return graph
