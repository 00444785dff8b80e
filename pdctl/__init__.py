"""pdctl: plan, deploy and prove SGLang prefill-decode (PD) disaggregated deployments.

The sub-packages live in the repository's top-level folders and are mapped into this
namespace by ``pyproject.toml``:

* ``pdctl.statemachine`` — spec, topology, plan, steps, journal, hosts (the engine);
* ``pdctl.units`` — SGLang/smg command lines, systemd units, service managers;
* ``pdctl.kernels`` — Triton sparse-MLA decode and lightning indexer (extra ``[kernels]``);
* ``pdctl.sim`` — the SGLang engine stand-in for machines without GPUs;
* ``pdctl.console`` — the ``pdctl`` CLI and the Textual console.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
