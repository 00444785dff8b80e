"""pdctl.statemachine"""
