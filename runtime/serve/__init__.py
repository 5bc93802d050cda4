"""``lmc serve``: an OpenAI-compatible HTTP server (``app``) over the
continuous-batching engine (``runtime.engine``), with Prometheus metrics
(``metrics``) and the KV pool sized for the machine (``pool``)."""
