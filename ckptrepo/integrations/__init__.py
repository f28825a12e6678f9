"""Adapters that plug ckptrepo into training frameworks through the extension point each already offers.

Each module imports its framework lazily (inside the functions and classes that need it), so importing
``ckptrepo`` never imports a framework, and each framework is an optional extra of the package.
"""
