"""The repository's model: the manifest schema, refs and revisions, and the version history.

Built on storage/; everything above reads and writes versions through it.
"""

from typing import TYPE_CHECKING

from ckptrepo._lazy import lazy_exports

# Facade: the names other layers import from this package, read from their modules when asked for (PEP 562)
# so that importing the package stays cheap. Its TYPE_CHECKING imports and _LAZY name the same (test_facades.py).
if TYPE_CHECKING:
    from ckptrepo.core._boxes import Box, check_coverage, flat_boxes, intersect, row_major_strides, runs, slices, volume
    from ckptrepo.core._config_repair import repair_config
    from ckptrepo.core._create import create_store
    from ckptrepo.core._gcpause import collection_paused
    from ckptrepo.core._history import every_ref_target, first_parent_headers, in_steps, log_versions, metric_rows
    from ckptrepo.core._lru import LruCache
    from ckptrepo.core._manifest import (
        COMPRESSION_SETTING,
        CONFIG_KEY,
        CONFIG_MAX_BYTES,
        DATA_PREFIX,
        FAILURES_PREFIX,
        FORMAT_VERSION,
        HEADS_PREFIX,
        LOST_PREFIX,
        PRUNED_PREFIX,
        PRUNING_PREFIX,
        PRUNING_STALE_S,
        STAGING_PREFIX,
        TAGS_PREFIX,
        VERSIONS_PREFIX,
        Version,
        decode_config,
        encode_config,
        is_version_id,
        msgpack_int,
        new_version_id,
        plain_metrics,
        seal,
        unseal,
        update_config,
        version_id_time,
    )
    from ckptrepo.core._manifest_reads import (
        HEADER_BATCH,
        children_first,
        find_cycle,
        first_parent_chain,
        first_parents,
        missing_manifest,
        parent_cycle_error,
    )
    from ckptrepo.core._moments import Moments, merge_moments
    from ckptrepo.core._plumbing import Plumbing
    from ckptrepo.core._refs import (
        LANDED_WALK,
        Head,
        check_ref_name,
        init_head,
        is_new_ref_name,
        lost_head_branch,
        replaced_refs,
    )
    from ckptrepo.core._remotes import (
        CLONING_SETTING,
        REMOTE_REFS_PREFIX,
        PushLease,
        add_remote,
        check_remote_name,
        clear_push_failure,
        evicted_ids,
        evicted_remote,
        interrupted_clone,
        leased_versions,
        mark_evicted,
        record_push_failure,
        remote_url,
        remotes,
        remove_remote,
        set_tracking_ref,
        tracking_refs,
        tracking_tip,
    )
    from ckptrepo.core._same_store import check_not_itself, refuse_if_same_store
    from ckptrepo.core._whereabouts import check_evicted, gone_there, require_data_somewhere, version_durability

_LAZY = {
    "ckptrepo.core._boxes": ("Box", "check_coverage", "flat_boxes", "intersect", "row_major_strides", "runs", "slices",
                             "volume"),
    "ckptrepo.core._config_repair": ("repair_config",),
    "ckptrepo.core._create": ("create_store",),
    "ckptrepo.core._gcpause": ("collection_paused",),
    "ckptrepo.core._history": ("every_ref_target", "first_parent_headers", "in_steps", "log_versions", "metric_rows"),
    "ckptrepo.core._lru": ("LruCache",),
    "ckptrepo.core._manifest": ("COMPRESSION_SETTING", "CONFIG_KEY", "CONFIG_MAX_BYTES", "DATA_PREFIX",
                                "FAILURES_PREFIX", "FORMAT_VERSION", "HEADS_PREFIX", "LOST_PREFIX", "PRUNED_PREFIX",
                                "PRUNING_PREFIX", "PRUNING_STALE_S", "STAGING_PREFIX", "TAGS_PREFIX", "VERSIONS_PREFIX",
                                "Version", "decode_config", "encode_config", "is_version_id", "msgpack_int",
                                "new_version_id", "plain_metrics", "seal", "unseal", "update_config",
                                "version_id_time"),
    "ckptrepo.core._manifest_reads": ("HEADER_BATCH", "children_first", "find_cycle", "first_parent_chain",
                                      "first_parents", "missing_manifest", "parent_cycle_error"),
    "ckptrepo.core._moments": ("Moments", "merge_moments"),
    "ckptrepo.core._plumbing": ("Plumbing",),
    "ckptrepo.core._refs": ("Head", "LANDED_WALK", "check_ref_name", "init_head", "is_new_ref_name", "lost_head_branch",
                            "replaced_refs"),
    "ckptrepo.core._remotes": ("CLONING_SETTING", "PushLease", "REMOTE_REFS_PREFIX", "add_remote", "check_remote_name",
                               "clear_push_failure", "evicted_ids", "evicted_remote", "interrupted_clone",
                               "leased_versions", "mark_evicted", "record_push_failure", "remote_url", "remotes",
                               "remove_remote", "set_tracking_ref", "tracking_refs", "tracking_tip"),
    "ckptrepo.core._same_store": ("check_not_itself", "refuse_if_same_store"),
    "ckptrepo.core._whereabouts": ("check_evicted", "gone_there", "require_data_somewhere", "version_durability"),
}
if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = ["Box", "CLONING_SETTING", "COMPRESSION_SETTING", "CONFIG_KEY", "CONFIG_MAX_BYTES", "DATA_PREFIX",
           "FAILURES_PREFIX", "FORMAT_VERSION", "HEADER_BATCH", "HEADS_PREFIX", "Head", "LANDED_WALK", "LOST_PREFIX",
           "LruCache", "Moments", "PRUNED_PREFIX", "PRUNING_PREFIX", "PRUNING_STALE_S", "Plumbing", "PushLease",
           "REMOTE_REFS_PREFIX", "STAGING_PREFIX", "TAGS_PREFIX", "VERSIONS_PREFIX", "Version", "add_remote",
           "check_coverage", "check_evicted", "check_not_itself", "check_ref_name", "check_remote_name",
           "children_first", "clear_push_failure", "collection_paused", "create_store", "decode_config",
           "encode_config", "every_ref_target", "evicted_ids", "evicted_remote", "find_cycle", "first_parent_chain",
           "first_parent_headers", "first_parents", "flat_boxes", "gone_there", "in_steps", "init_head",
           "interrupted_clone", "intersect", "is_new_ref_name", "is_version_id", "leased_versions", "log_versions",
           "lost_head_branch", "mark_evicted", "merge_moments", "metric_rows", "missing_manifest", "msgpack_int",
           "new_version_id", "parent_cycle_error", "plain_metrics", "record_push_failure", "refuse_if_same_store",
           "remote_url", "remotes", "remove_remote", "repair_config", "replaced_refs", "require_data_somewhere",
           "row_major_strides", "runs", "seal", "set_tracking_ref", "slices", "tracking_refs", "tracking_tip", "unseal",
           "update_config", "version_durability", "version_id_time", "volume"]
# End of facade.
