"""run groups and event counts: process groups stored once per group; a run's events bounded and counted

``run_groups`` holds each process group a run's ``comm_group`` events describe once, not once per rank
(a 16,384-rank job whose ranks each listed their 16,384-rank data-parallel group stored that list
16,384 times): keyed by (run, dimension, a 16-byte digest of the membership), with its size and its
ranks as ``start``/``stride`` for an arithmetic progression, else a compressed int32 list (``ranks``,
``listed`` of them: older agents listed the first 256). ``comm_group`` events no longer go to
``run_events``; the ones older servers stored there stay and are read (bounded) for runs without groups.

``run_event_counts`` holds, per run and event kind, the rows stored, the events dropped beyond
``MAX_EVENTS_PER_RUN`` / ``MAX_EVENTS_PER_KIND`` (kind ``comm_group``: group descriptions beyond
``MAX_GROUPS_PER_RUN``) and the events stored folded (a reason cut); kind ``''`` is the run's total.
It is filled here from what ``run_events`` already holds (``comm_group`` rows left out).

Revision ID: 0015
Revises: 0014
"""
from alembic import op
import sqlalchemy as sa

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def _fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f(f'fk_{table}_run_id_runs'), ondelete='CASCADE')


def upgrade() -> None:
    op.create_table(
        'run_groups',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('dim', sa.String(length=64), nullable=False),
        sa.Column('key', sa.LargeBinary(), nullable=False),
        sa.Column('size', sa.Integer(), nullable=False),
        sa.Column('start', sa.Integer(), nullable=True),
        sa.Column('stride', sa.Integer(), nullable=True),
        sa.Column('listed', sa.Integer(), nullable=False),
        sa.Column('ranks', sa.LargeBinary(), nullable=True),
        sa.Column('name', sa.String(length=64), nullable=True),
        _fk('run_groups'),
        sa.PrimaryKeyConstraint('run_id', 'dim', 'key', name=op.f('pk_run_groups')),
    )
    op.create_table(
        'run_event_counts',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('kind', sa.String(length=64), nullable=False),
        sa.Column('stored', sa.BigInteger(), nullable=False, server_default='0'),
        sa.Column('dropped', sa.BigInteger(), nullable=False, server_default='0'),
        sa.Column('folded', sa.BigInteger(), nullable=False, server_default='0'),
        _fk('run_event_counts'),
        sa.PrimaryKeyConstraint('run_id', 'kind', name=op.f('pk_run_event_counts')),
    )
    op.execute(
        "INSERT INTO run_event_counts (run_id, kind, stored) "
        "SELECT e.run_id, e.kind, count(*) FROM run_events e JOIN runs r ON r.id = e.run_id "
        "WHERE e.kind <> 'comm_group' GROUP BY e.run_id, e.kind"
    )
    op.execute(
        "INSERT INTO run_event_counts (run_id, kind, stored) "
        "SELECT run_id, '', sum(stored) FROM run_event_counts GROUP BY run_id"
    )


def downgrade() -> None:
    op.drop_table('run_event_counts')
    op.drop_table('run_groups')
