-- Least privilege for direct writers: the publish functions run with the rights of the
-- outbox's owner (they must read the table to compare a re-published event), so a
-- writer needs only EXECUTE on them — not SELECT on other services' events. A fixed
-- search_path keeps callers from substituting their own objects.
DO $$
BEGIN
    EXECUTE format(
        'ALTER FUNCTION outbox_publish_bytes(text, text, text, bytea, text, jsonb, uuid, bigint, timestamptz) '
        'SECURITY DEFINER SET search_path = %I, pg_temp', current_schema());
    EXECUTE format(
        'ALTER FUNCTION outbox_publish(text, text, text, jsonb, jsonb, uuid, bigint, timestamptz) '
        'SECURITY DEFINER SET search_path = %I, pg_temp', current_schema());
END
$$;

-- Running with the owner's rights, the functions are no longer for everyone: grant
-- EXECUTE to the roles that publish (see deploy/writer-role.sql).
REVOKE EXECUTE ON FUNCTION outbox_publish_bytes(text, text, text, bytea, text, jsonb, uuid, bigint, timestamptz) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION outbox_publish(text, text, text, jsonb, jsonb, uuid, bigint, timestamptz) FROM PUBLIC;
