"""Test doubles for hardware the test machines do not have (the NVIDIA driver)."""
