"""Compatibility measurement: torch's OpInfo/ModuleInfo databases and script corpora run through the bridge."""
