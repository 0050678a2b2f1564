"""No import circles inside `hpcml.data` (issue 30 item 11): on main `sources` <-> `tokens`,
`sources` <-> `shard_sources` and `shards` <-> `store` imported each other (at module level
or inside functions). Read from the code with grimp, the import graph import-linter builds
(`make lint`), counting imports inside functions too."""

from __future__ import annotations

import itertools

import grimp


def test_the_modules_of_hpcml_data_import_one_way() -> None:
    graph = grimp.build_graph("hpcml")
    modules = sorted(m for m in graph.modules if m.startswith("hpcml.data."))
    assert len(modules) > 10  # the graph saw the package
    circles = [
        graph.find_shortest_chain(a, b) + graph.find_shortest_chain(b, a)[1:]  # type: ignore[operator]
        for a, b in itertools.combinations(modules, 2)
        if graph.find_shortest_chain(a, b) and graph.find_shortest_chain(b, a)
    ]
    assert not circles, circles
