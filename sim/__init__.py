"""pdctl.sim"""
