"""Hardware: profiles, topology detection, calibration probes, roofline."""
