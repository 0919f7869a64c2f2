"""Stopping a calibrate run at a layer's end, as a kill between layers would."""

from __future__ import annotations

from ds4quant.progress import EventKind


class Stop(Exception):
    """Raised by ``stop_after``'s progress callback."""


def stop_after(layer: int):
    """A progress callback that stops the run once layer ``layer`` is finished."""
    def progress(ev):
        if ev.kind is EventKind.STEP and ev.item == f"layer {layer}":
            raise Stop
    return progress
