"""The anchors: the third-party systems each benchmark runs beside phalanx.

phalanx's side of every benchmark uses only phalanx's public API (the names in each
package's ``__all__``). Where an anchor can only be driven the way the benchmark needs
through that system's internals, the code doing so sits here, one module per anchor,
whose docstring says which internals and why; so a release of the anchor that moves
them breaks one file, and a reader sees at once what is not a public API.

* ``lmcache_disk``: LMCache's ``fs_native`` disk path, driven through its L2 adapter (a
  script run by the LMCache venv's python; never imported here).
* ``torch_store``: torch's store-based barrier (the rendezvous benchmark).

gloo (the domains benchmark) and ``multiprocessing.Pool`` (the worker benchmark) are
driven through their public APIs, in the benchmark modules themselves.
"""
