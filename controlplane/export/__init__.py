"""The fleet going out: the families of series a heartbeat makes (series),
/metrics (exposition) and the control plane's own metrics."""
