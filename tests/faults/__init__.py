"""Fault suite: the real agent (subprocess), a real mosquitto and real GStreamer RTSP cameras, broken on
purpose (README "Faults and recovery"). Shared helpers live in ``faults.harness``."""
