"""Performance models of compiled programs: the roofline cost model (``perf.roofline``)."""
