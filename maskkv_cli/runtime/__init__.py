"""Small utilities every layer may use and that import no stage of the flow: the allocator setting applied at
start-up (``allocator.py``), the device resolver and what the machine is (``devices.py``), the one atomic write
(``fileio.py``), the size formatter (``sizes.py``) and run statistics, timers and memory readings
(``stats.py``)."""
