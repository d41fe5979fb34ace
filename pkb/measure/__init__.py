"""Commands that measure the machine and the suite through the harness: ``pkb calibrate`` (the machine's
real bandwidths and rates: a calibrated profile, pkb.hardware.stored), ``pkb baseline`` (every reference's
time against the roofline), and the single-device probes they time (``probes``). The machine model they
feed (profiles, detection, the roofline) is pkb.hardware, below the harness."""
