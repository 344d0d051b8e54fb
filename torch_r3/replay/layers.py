"""The layer map: which index of the routes' layer axis each router reads.

Inference engines send routes for every decoder layer (dense layers as filler
rows) or for the MoE layers only; a pipeline stage may receive its own MoE
layers only, and a caller may name the layers the routes hold
(`route_layers=`). Both replay hooks read the routes' `L` the same way, here.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch_r3.keys import ROUTES

__all__ = ["route_layer_index", "route_layer_map"]  # `moe_pattern` serves the hooks


def moe_pattern(layers: Sequence[int], num_layers: int) -> tuple[bool, ...]:
    """One bool per decoder layer, `True` for the layers in `layers` (those that hold a router).

    Examples:
        >>> moe_pattern([1, 2], 3)
        (False, True, True)
    """
    held = set(layers)
    return tuple(layer in held for layer in range(num_layers))


def route_layer_index(layer: int, routes_layers: int, pattern: Sequence[bool]) -> int:
    """Map a router's global layer (0-based) to an index into the routes' `L` dim.

    Inference engines report routes either for every transformer layer
    (`L == num_layers`; dense layers carry filler) or for the MoE layers only
    (`L` == number of MoE layers, in layer order). Both are accepted and told
    apart by `L`.

    Args:
        layer: The router's global layer index, 0-based.
        routes_layers: `L`, the routes' layer dimension.
        pattern: `moe_layer_pattern` of the model.

    Returns:
        The index into `L`.

    Raises:
        ValueError: When `L` matches neither count, or `layer` is no MoE layer.

    Examples:
        >>> pattern = (False, True, True)  # one dense layer, then two MoE layers
        >>> route_layer_index(2, 3, pattern), route_layer_index(2, 2, pattern)
        (2, 1)
    """
    if not 0 <= layer < len(pattern):
        raise ValueError(f"layer {layer} is outside the model's {len(pattern)} layers")
    if routes_layers == len(pattern):
        return layer
    num_moe = sum(pattern)
    if routes_layers == num_moe:
        if not pattern[layer]:
            raise ValueError(
                f"layer {layer} has a router but the model's layer pattern marks it dense; "
                f"cannot map it into routes that cover only the {num_moe} MoE layers"
            )
        return sum(pattern[:layer])
    raise ValueError(
        f"{ROUTES} has {routes_layers} layers; expected num_layers = "
        f"{len(pattern)} (every layer) or {num_moe} (MoE layers only)"
    )


def route_layer_map(
    layers: Sequence[int],
    routes_layers: int,
    pattern: Sequence[bool],
    *,
    route_layers: Sequence[int] | None = None,
) -> list[int]:
    """Map each router's global layer to an index into the routes' `L` dim, stage-only routes included.

    Three layouts of `L` are accepted:

    * every transformer layer (`L == num_layers`) or the MoE layers only
      (`L` == the model's MoE layer count), as `route_layer_index` reads them;
    * only this pipeline stage's MoE layers, in layer order (`L == len(layers)`
      when that is neither count above), so a stage never receives the others';
    * explicitly, `route_layers`: the global layer (0-based) that each index of
      `L` holds, for any other subset.

    Args:
        layers: Global layers (0-based) of this stage's replayed routers, in model order.
        routes_layers: `L`, the routes' layer dimension.
        pattern: `moe_layer_pattern` of the model.
        route_layers: The global layer of each index of `L`, or `None` to tell the layout by `L`.

    Returns:
        One index into `L` per router, in the order of `layers`.

    Raises:
        ValueError: When `L` fits no layout, or `route_layers` does not have `L`
            entries or lacks one of `layers`.

    Examples:
        >>> pattern = (True, True, True, True)  # four MoE layers, two stages of two
        >>> route_layer_map([2, 3], 4, pattern), route_layer_map([2, 3], 2, pattern)
        ([2, 3], [0, 1])
        >>> route_layer_map([2, 3], 3, pattern, route_layers=[1, 2, 3])
        [1, 2]
    """
    if route_layers is not None:
        held = list(route_layers)
        if routes_layers != len(held):
            raise ValueError(f"{ROUTES} has {routes_layers} layers but route_layers names {len(held)} ({held})")
        missing = [layer for layer in layers if layer not in held]
        if missing:
            raise ValueError(
                f"route_layers={held} does not hold layer {missing[0]}, which this stage's router "
                f"replays (this stage's MoE layers: {list(layers)})"
            )
        return [held.index(layer) for layer in layers]
    if routes_layers not in (len(pattern), sum(pattern)) and routes_layers == len(layers):
        return list(range(routes_layers))  # stage-only routes, in layer order
    try:
        return [route_layer_index(layer, routes_layers, pattern) for layer in layers]
    except ValueError as err:
        if routes_layers in (len(pattern), sum(pattern)) or len(layers) == sum(pattern):
            raise  # (routers on every MoE layer: stage-only routes are the MoE-only layout)
        raise ValueError(
            f"{err}, or {len(layers)} (this pipeline stage's MoE layers {list(layers)} only); "
            "for another subset pass route_layers= to ReplayHook"
        ) from None
