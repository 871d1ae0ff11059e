"""Test support: real servers (Redis, HTTP) started on loopback for the tests."""
