"""``ckptrepo ui``: a local web page over a repository's history (docs/ui.md).

The page (static/: HTML, JavaScript and CSS, with uPlot vendored under its MIT licence) needs no build step
and fetches nothing from the internet; it draws the version graph, the metric curves, a heatmap of a
per-tensor statistic over the steps, and one version's header, tensors and diff, from the JSON endpoints of
``_server`` (answered by ``_api``). It only reads the repository.
"""
from __future__ import annotations

from ckptrepo.ui._server import HOST, UIServer, make_server, serve

__all__ = ["HOST", "UIServer", "make_server", "serve"]
