"""Dispatch: a planned request becomes jobs on Redis streams, and its reply events come back in
order.
"""
