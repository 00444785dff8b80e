"""pdctl.console"""
