"""Shrinking a group in the process and splitting groups off it, over every kind of link."""
