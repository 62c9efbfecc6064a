-- Strata's two database roles (run once by the postgres image on an empty data directory, as the
-- superuser, in the database POSTGRES_DB; or by hand: psql -U postgres -d strata -f this-file).
--
--   migrate role (STRATA_DB_MIGRATE_USER, default strata_migrate): owns the database and the schema,
--     so it creates and alters tables, triggers and functions. Only the one-shot `migrate` service
--     of docker-compose.yml connects with it.
--   app role (STRATA_DB_APP_USER, default strata_app): what web and Celery connect with. It may
--     read and write rows (SELECT, INSERT, UPDATE, DELETE on tables; USAGE, SELECT on sequences) and
--     nothing else: it owns nothing, so it cannot drop or disable the audit triggers, alter or
--     truncate the audit table, replace the trigger functions or create objects.
--
-- Passwords come from STRATA_DB_MIGRATE_PASSWORD and STRATA_DB_APP_PASSWORD (required; psql 15+).
\set ON_ERROR_STOP on
\set migrate_role strata_migrate
\set app_role strata_app
\getenv migrate_role STRATA_DB_MIGRATE_USER
\getenv app_role STRATA_DB_APP_USER
\getenv migrate_password STRATA_DB_MIGRATE_PASSWORD
\getenv app_password STRATA_DB_APP_PASSWORD
\if :{?migrate_password}
\else
  DO $$ BEGIN RAISE EXCEPTION 'STRATA_DB_MIGRATE_PASSWORD is not set'; END $$;
\endif
\if :{?app_password}
\else
  DO $$ BEGIN RAISE EXCEPTION 'STRATA_DB_APP_PASSWORD is not set'; END $$;
\endif

BEGIN;

CREATE ROLE :"migrate_role" LOGIN PASSWORD :'migrate_password';
CREATE ROLE :"app_role" LOGIN PASSWORD :'app_password';

-- The migrate role owns the database and its public schema; nobody else may create anything there.
SELECT format('ALTER DATABASE %I OWNER TO %I', current_database(), :'migrate_role') \gexec
SELECT format('REVOKE ALL ON DATABASE %I FROM PUBLIC', current_database()) \gexec
SELECT format('GRANT CONNECT ON DATABASE %I TO %I', current_database(), :'app_role') \gexec
ALTER SCHEMA public OWNER TO :"migrate_role";
REVOKE ALL ON SCHEMA public FROM PUBLIC;
GRANT USAGE ON SCHEMA public TO :"app_role";

-- Row access for the app role, on what exists now and on every table and sequence the migrate role
-- creates later (Django's migrations).
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO :"app_role";
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO :"app_role";
ALTER DEFAULT PRIVILEGES FOR ROLE :"migrate_role" IN SCHEMA public
    GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO :"app_role";
ALTER DEFAULT PRIVILEGES FOR ROLE :"migrate_role" IN SCHEMA public
    GRANT USAGE, SELECT ON SEQUENCES TO :"app_role";

COMMIT;
