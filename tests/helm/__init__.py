"""Tests of the Helm chart helm/epd."""
