"""Can this draft be served with this target, and with what settings?

``compat``    does a drafter fit a target (hidden size, vocabulary, layer ids, Kimi K3's capture switch)
``settings``  every runtime setting, resolved once into one frozen ``DSparkSettings``
``validate``  the start-up check that combines both into one error message

This layer sits below ``spec_decode/`` and ``patch/`` and imports neither (nor vLLM).
"""
