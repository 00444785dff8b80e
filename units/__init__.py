"""pdctl.units"""
