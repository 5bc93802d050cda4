"""``lmc viz``: the compiler shown in a browser, as tinygrad's ``VIZ=1`` shows
its rewrites: the graph after every pass (``steps``), what each pass changed
(``diff``), a node and its kernel as IR, assembly and llvm-mca analysis
(``nodes``, ``kernel_code``), the memory plan and the profile, all gathered
once (``session``) and served by a local web app (``app``: the page in
``static/`` and its JSON API; ``server``: the socket, signals, the browser)."""
