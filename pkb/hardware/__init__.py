"""The machine model: hardware profiles (datasheets and calibrated ones as stored), topology detection, and
the roofline that turns a problem's cost into a lower bound on its time. Nothing here runs the harness:
the commands that measure through it are pkb.measure."""
